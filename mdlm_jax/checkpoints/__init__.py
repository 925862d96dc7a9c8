"""Weights on disk and back: orbax training checkpoints (`checkpointer`),
params-only folders, safetensors, the LLaDA/Dream Hugging Face layouts
(`interop`), chat templates, the packaged models, and `load`, which reads any
of them onto a mesh as a `LoadedModel`."""

from mdlm_jax.checkpoints import interop, packaged, params_only, safetensors
from mdlm_jax.checkpoints.checkpointer import CheckpointError
from mdlm_jax.checkpoints.loading import LoadedModel, load

__all__ = ["interop", "packaged", "params_only", "safetensors", "CheckpointError", "LoadedModel", "load"]
