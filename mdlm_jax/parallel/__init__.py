"""Running the same program on one CPU, a GPU node or a TPU pod: the mesh and
the logical-axis rules (`sharding`), multi-process start-up (`distributed`)
and process-level runtime setup (`runtime`). No module hard-codes a device
count."""

from mdlm_jax.parallel.sharding import batch_sharding, constrain, logical_to_spec, make_mesh

__all__ = ["batch_sharding", "constrain", "logical_to_spec", "make_mesh"]
