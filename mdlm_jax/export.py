"""python -m mdlm_jax.export --checkpoint=DIR --out=DIR [--dtype bfloat16]

Writes a training checkpoint's inference weights (the EMA when the run kept
one) as a params-only folder: config.json, tokenizer.model and
model.safetensors. Every command that takes --checkpoint reads the result.
"""

from __future__ import annotations

import argparse
import os
import sys

from mdlm_jax import cli


def parse(argv):
  from mdlm_jax.params_only import DTYPES
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.export", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", required=True, help="training workdir, checkpoints/ folder or step folder")
  p.add_argument("--out", required=True, help="folder to write (must not exist unless --overwrite)")
  p.add_argument("--format", default="params", choices=("params",),
                 help="params: this package's params-only folder (safetensors + config.json)")
  p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="stored weight dtype")
  p.add_argument("--no-ema", action="store_true", help="export the raw params, not the EMA")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
  return p.parse_args(argv)


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  cli.drop_closed_loop_noise()
  try:
    from mdlm_jax import builder, params_only
    if params_only.is_params_dir(a.checkpoint):
      raise ValueError(f"{a.checkpoint} is already a params-only folder")
    loaded = builder.load(a.checkpoint, use_ema=not a.no_ema)
    out = params_only.save(a.out, loaded.params, loaded.config, loaded.tokenizer.to_bytes(), step=loaded.step,
                           dtype=a.dtype, overwrite=a.overwrite,
                           extra={"weights": "ema" if loaded.has_ema and not a.no_ema else "params",
                                  "objective": loaded.config.objective})
  except (*cli.USER_ERRORS, FileExistsError) as e:
    cli.fail("export", e)
  size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
  print(f"wrote {out}: step {loaded.step}, {a.dtype}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
  main()
