"""A checkpoint's likelihood on a corpus: the NELBO bound of a diffusion
model (Monte Carlo over t, seeded) or an AR model's exact perplexity, on its
training corpus's validation split or on given documents. Flag-free, so
benchmarks and tests call it without `python -m mdlm_jax.eval`'s flags."""

from __future__ import annotations


def eval_mesh(mesh_text: str | None):
  """The --mesh over the first devices; else every device of a multi-process
  run (data parallel); else None (one device)."""
  import jax
  from mdlm_jax import config as config_lib
  from mdlm_jax.parallel import sharding
  if mesh_text is None:
    return sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}) if jax.process_count() > 1 else None
  sizes = config_lib.parse_mesh(mesh_text)
  n = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
  if n > jax.device_count() or (jax.process_count() > 1 and n != jax.device_count()):
    raise ValueError(f"--mesh={mesh_text} needs {n} devices; this run has {jax.device_count()}"
                     f"{' (a multi-process mesh must use them all)' if jax.process_count() > 1 else ''}")
  return sharding.make_mesh(sizes, jax.devices()[:n])


def evaluate_checkpoint(checkpoint_path, data_path=None, text_field=None, num_batches=None, batch_size=None,
                        time_samples=None, seed=None, raw_params=False, mesh_text=None, profile=0,
                        seq_len=None, decode_dtype="float32") -> dict:
  from mdlm_jax import data
  from mdlm_jax.training import evaluation
  from mdlm_jax.diffusion import objectives
  from mdlm_jax import checkpoints
  from mdlm_jax.model.spec import for_decoding, resolve_decode_dtype
  import jax
  mesh = eval_mesh(mesh_text)
  loaded = checkpoints.load(checkpoint_path, mesh=mesh, use_ema=not raw_params)
  c = loaded.config
  decode_dtype = resolve_decode_dtype(loaded, decode_dtype)
  if decode_dtype != "float32":  # the int8 copy a decoder reads, its adapters joined
    loaded = for_decoding(loaded, decode_dtype=decode_dtype)
  text_field = text_field or c.data.text_field
  if data_path:
    docs = data.load_all_documents(data_path, text_field)
  else:
    docs = data.load_documents(c.data.corpus, "validation", c.data.validation_fraction, text_field)
  for name, v in (("num_batches", num_batches), ("batch_size", batch_size), ("time_samples", time_samples),
                  ("seq_len", seq_len)):
    if v is not None and v < 1:
      raise ValueError(f"--{name} must be >= 1, got {v}")
  batch_size = batch_size or c.data.batch_size
  shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % shards:
    raise ValueError(f"--batch_size={batch_size} does not split over the mesh's {shards} batch shards")
  batches = data.make_eval_batches(docs, loaded.tokenizer, seq_len=seq_len or c.data.seq_len, batch_size=batch_size,
                                   num_batches=num_batches or c.eval.num_batches)
  objective = objectives.from_config(c, loaded.tokenizer.mask_id)
  res = evaluation.evaluate(loaded.spec, objective, loaded.params, batches,
                            time_samples=time_samples or c.eval.time_samples,
                            seed=c.eval.seed if seed is None else seed, mesh=mesh)
  if profile:
    if profile < 0 or jax.process_count() > 1:
      raise ValueError(f"--profile must be >= 0 and runs in one process, got {profile}"
                       f" over {jax.process_count()} processes")
    res["profile"] = evaluation.bound_profile(loaded.spec, objective, loaded.params, batches, time_samples=profile,
                                              seed=c.eval.seed if seed is None else seed)
  res.update({"checkpoint": checkpoint_path, "step": loaded.step, "seq_len": seq_len or c.data.seq_len,
              "objective": c.objective, "decode_dtype": decode_dtype,
              "data": data_path or f"{c.data.corpus} (validation)",
              "params": "raw" if raw_params or not loaded.has_ema else "ema"})
  return res
