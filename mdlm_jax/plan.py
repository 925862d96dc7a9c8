"""python -m mdlm_jax.plan: per-device memory of the train step on a mesh
(see `mdlm_jax.training.memory_plan`)."""

from absl import app

from mdlm_jax.training.memory_plan import main, parse_flags

if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
