"""python -m mdlm_jax.export --checkpoint=DIR --out=DIR [--format native|llada|dream] [--dtype bfloat16]

Writes a checkpoint's inference weights (the EMA when the run kept one) as
params-only safetensors: our own layout (native: config.json, tokenizer.model or .json,
model.safetensors) or the Hugging Face layout of LLaDA or Dream (mdlm_jax/
checkpoints/families.py has the name tables). With --import it goes the other
way: a Hugging Face folder (LLaDA, Dream, Llama, Qwen2, Qwen3) or a GGUF file
becomes a native folder, which later loads without dequantizing or renaming.
Every command that takes --checkpoint reads all of these.

  python -m mdlm_jax.export --import --checkpoint=HF_DIR|FILE.gguf --out=DIR [--tokenizer=tok.model]
"""

from __future__ import annotations

import argparse
import os
import sys

from mdlm_jax import cli

FORMATS = ("native", "params", "llada", "dream")  # params: the old name of native
IMPORT_FORMATS = ("llada", "dream", "llama", "qwen2", "qwen3", "gguf")  # what --format may name with --import


def parse(argv):
  from mdlm_jax.checkpoints.params_only import DTYPES
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.export", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", required=True,
                 help="training workdir, checkpoints/ folder, step folder or exported folder;"
                      " with --import, a LLaDA/Dream-layout folder")
  p.add_argument("--out", required=True, help="folder to write (must not exist unless --overwrite)")
  p.add_argument("--format", default="native", choices=sorted(set(FORMATS + IMPORT_FORMATS), key=(FORMATS +
                                                                                                 IMPORT_FORMATS).index),
                 help="native (alias params): this package's params-only folder; llada, dream: the Hugging"
                      " Face layout of LLaDA or Dream (Qwen2 names); with --import, the layout of --checkpoint"
                      " (llada, dream, llama, qwen2, qwen3 or gguf; read from the checkpoint when left out)")
  p.add_argument("--import", dest="import_", action="store_true",
                 help="convert a Hugging Face folder or GGUF file --checkpoint into a native params-only --out")
  p.add_argument("--tokenizer", default="",
                 help="with --import: the tokenizer to use, a sentencepiece .model or a Hugging Face .json"
                      " (default: --checkpoint/tokenizer.model, else --checkpoint/tokenizer.json)")
  p.add_argument("--dtype", default=None, choices=DTYPES,
                 help="stored weight dtype (default: bfloat16; float32 with --import, which keeps the weights exact)")
  p.add_argument("--max-shard-size", default="5GB",
                 help="split the weights into model-0000i-of-0000n.safetensors shards past this size")
  p.add_argument("--no-ema", action="store_true", help="export the raw params, not the EMA")
  p.add_argument("--adapters-only", action="store_true",
                 help="write the low-rank adapters alone (megabytes); loading reads the rest from the run's"
                      " train.init_from base")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
  a = p.parse_args(argv)
  a.dtype = a.dtype or ("float32" if a.import_ else "bfloat16")
  return a


def import_folder(a, max_shard: int) -> tuple[str, int]:
  from mdlm_jax.checkpoints import interop, params_only
  from mdlm_jax.model.spec import model_spec
  from mdlm_jax.model import ModelConfig
  from mdlm_jax.checkpoints import gguf_file
  from mdlm_jax.data import chat_template
  if not os.path.exists(a.checkpoint):
    raise FileNotFoundError(f"--checkpoint {a.checkpoint} does not exist")
  if gguf_file.is_gguf(a.checkpoint):
    fmt = "gguf"
    if a.tokenizer:
      raise ValueError("--tokenizer: a GGUF file carries its own tokenizer")
  else:
    fmt = interop.hf_format(a.checkpoint)
    if fmt is None:
      interop.read(a.checkpoint)  # raises, naming what the folder lacks
  if a.format not in ("native", "params") and a.format != fmt:
    raise ValueError(f"--format={a.format} but {a.checkpoint} holds a {fmt} checkpoint")
  if fmt == "gguf":
    config, tok, named, step, template = gguf_file.read(a.checkpoint)
  else:
    config, tok, named, step = interop.read(a.checkpoint, a.tokenizer or None)
    template = chat_template.from_folder(a.checkpoint)
  spec = model_spec(ModelConfig.from_config(config.model, vocab_size=tok.vocab_size), None)
  params = params_only.unflatten_like(spec.abstract, named, a.checkpoint)
  out = params_only.save(a.out, params, config, tok, step=step, dtype=a.dtype, overwrite=a.overwrite,
                         max_shard_bytes=max_shard, extra={"weights": f"imported from {fmt}",
                                                           "objective": config.objective},
                         chat_template=template)
  return out, step


def export_folder(a, max_shard: int) -> tuple[str, int]:
  from mdlm_jax.checkpoints import interop, params_only
  from mdlm_jax import checkpoints
  native = a.format in ("native", "params")
  if native and params_only.is_params_dir(a.checkpoint):
    raise ValueError(f"{a.checkpoint} is already a params-only folder")
  if a.tokenizer:
    raise ValueError("--tokenizer is for --import only")
  if a.adapters_only and not native:
    raise ValueError("--adapters-only writes a native params-only folder")
  if not native and a.format not in interop.FORMATS:
    raise ValueError(f"--format={a.format} is read with --import; export writes {', '.join(FORMATS)}")
  loaded = checkpoints.load(a.checkpoint, use_ema=not a.no_ema)
  if not native:
    out = interop.save(a.out, a.format, loaded.params, loaded.config, loaded.tokenizer, step=loaded.step,
                       dtype=a.dtype, max_shard_bytes=max_shard, overwrite=a.overwrite,
                       chat_template=loaded.chat_template)
    return out, loaded.step
  base = None
  if a.adapters_only:
    from mdlm_jax.checkpoints.loading import frozen_base
    base = frozen_base(loaded.config)  # through earlier adapter stages, to the weights they all kept
    if not base or loaded.config.train.trainable != "adapters":
      raise ValueError("--adapters-only exports a run that trained adapters alone (train.trainable=adapters) over"
                       " a train.init_from base")
  out = params_only.save(a.out, loaded.params, loaded.config, loaded.tokenizer, step=loaded.step,
                         dtype=a.dtype, overwrite=a.overwrite, max_shard_bytes=max_shard,
                         extra={"weights": "ema" if loaded.has_ema and not a.no_ema else "params",
                                "objective": loaded.config.objective},
                         chat_template=loaded.chat_template, base=base)
  return out, loaded.step


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  cli.drop_closed_loop_noise()
  try:
    from mdlm_jax.checkpoints import safetensors
    try:
      max_shard = safetensors.parse_size(a.max_shard_size)
    except ValueError as e:
      raise ValueError(f"--max-shard-size: {e}") from None
    out, step = import_folder(a, max_shard) if a.import_ else export_folder(a, max_shard)
  except (*cli.USER_ERRORS, FileExistsError) as e:
    cli.fail("export", e)
  size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
  layout = "native" if a.import_ or a.format == "params" else a.format
  print(f"wrote {out}: {layout}, step {step}, {a.dtype}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
  main()
