"""A short fine-tune that stretches a trained model's context with RoPE scaling:

  python -m mdlm_jax.train --config=configs/extend_context.py:bd3_pycode,4,yarn \\
      --workdir=runs/bd3_pycode_4x --config.train.init_from=exports/bd3_pycode

The argument is BASE,FACTOR,TYPE: the config the model was trained with
(configs/BASE.py), how many times longer its context becomes, and the
scaling ("linear", "dynamic", "yarn" or "llama3"; yarn by default).
Sequences grow FACTOR times and the batch shrinks as much (the same tokens
per step, at least one sequence), the learning rate drops to a tenth, and
200 steps follow a short warm-up: long-context fine-tunes in the YaRN and
position-interpolation papers take a few hundred steps. A FACTOR of 1 keeps
the context and the scaling off (a control run).
"""

import os

from mdlm_jax.config import load_config_file


def get_config(arg: str = "pycode,4,yarn"):
  parts = arg.split(",")
  if not 1 <= len(parts) <= 3:
    raise ValueError(f"extend_context takes BASE[,FACTOR[,TYPE]], got {arg!r}")
  base, factor, kind = (parts + ["4", "yarn"][len(parts) - 1:])[:3]
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{base}.py"))
  factor = int(factor)
  if factor < 1:
    raise ValueError(f"extend_context: FACTOR must be a positive integer, got {factor}")
  trained = int(c.data.seq_len)
  if factor > 1:
    c.model.rope_scaling.update(type=kind, factor=float(factor), max_position=trained)
  c.data.seq_len = trained * factor
  c.data.batch_size = max(1, c.data.batch_size // factor)
  c.optim.update(learning_rate=c.optim.learning_rate / 10, warmup_steps=20)
  c.train.update(num_steps=200, eval_every=100)
  return c
