"""lm-eval tasks that run offline (`python -m mdlm_jax.harness` includes this folder)."""
