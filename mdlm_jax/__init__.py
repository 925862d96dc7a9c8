"""Masked diffusion language models in JAX/Flax."""
