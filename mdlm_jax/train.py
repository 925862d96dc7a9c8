"""python -m mdlm_jax.train --config=configs/NAME.py --workdir=DIR [--config.x=y ...]

Trains an MDLM (or its AR twin), resuming from DIR when it holds a checkpoint.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from mdlm_jax import cli
from mdlm_jax.parallel import distributed

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/NAME.py)")
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and plots")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = distributed.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    cli.fail("train", ValueError(f"unexpected arguments {argv[1:]}"))
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  cli.drop_closed_loop_noise()
  from mdlm_jax.parallel import runtime
  from mdlm_jax.training import trainer
  c = _CONFIG.value
  multi = distributed.wanted(_COORDINATOR.value, _NUM_PROCESSES.value)
  if not multi:
    runtime.split_cpu_into_devices(max(1, c.data.batch_size // max(1, c.optim.grad_accum_steps)))
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    trainer.train(_CONFIG.value, _WORKDIR.value)
  except cli.USER_ERRORS as e:
    cli.fail("train", e)


if __name__ == "__main__":
  app.run(main)
