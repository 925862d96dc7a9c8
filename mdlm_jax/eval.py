"""python -m mdlm_jax.eval --checkpoint=DIR [--data=PATH] [--seq_len=N] [--profile=8] [--json]

NELBO / perplexity bound of an MDLM checkpoint (Monte Carlo over t, seeded),
or the exact perplexity of an AR checkpoint, on the validation split of the
training corpus or on the documents at --data. --profile adds the bound's
integrand by noise level (and block position): where a diffusion model's
bound loses to its AR twin.

Launched on several hosts (like train), the processes connect first and the
batches are split over one mesh of all their devices; process 0 prints.
"""

import json

from absl import app, flags, logging

from mdlm_jax import cli
from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
from mdlm_jax.parallel import distributed

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "workdir, checkpoints/ folder or step folder")
_DATA = flags.DEFINE_string("data", None, "folder, glob or .jsonl to evaluate on (default: validation split)")
_TEXT_FIELD = flags.DEFINE_string("text_field", None, "jsonl text field (default: the training config's)")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", None, "batches to evaluate (default: config.eval.num_batches)")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "sequences per batch (default: config.data.batch_size)")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "tokens per evaluated row (default: config.data.seq_len; an"
                                " imported model's is its whole context)")
_TIME_SAMPLES = flags.DEFINE_integer("time_samples", None, "MC samples of t per sequence (MDLM only)")
_SEED = flags.DEFINE_integer("seed", None, "seed of the t/mask draws (default: config.eval.seed)")
_RAW = flags.DEFINE_bool("raw_params", False, "evaluate the raw params instead of the EMA")
_PROFILE = flags.DEFINE_integer("profile", 0, "diffusion only: also the bound's integrand at this many noise"
                                " levels t, and by position in the block (where the bound is lost)")
_DECODE_DTYPE = flags.DEFINE_enum("decode_dtype", "float32", list(DECODE_DTYPE_CHOICES),
                                  "score with the weights a decoder reads (one device): float32 as trained, or"
                                  " the int8 copy `sample --decode-dtype` decodes from; the bound and perplexity"
                                  " then say what that rounding costs")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a sentence")
_MESH = flags.DEFINE_string("mesh", None, "device mesh, e.g. 'data=4,fsdp=2' (default: one device, or data"
                            " parallel over every device of a multi-process run)")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = distributed.define_flags()
flags.mark_flag_as_required("checkpoint")


def main(argv):
  if len(argv) > 1:
    cli.fail("eval", ValueError(f"unexpected arguments {argv[1:]}"))
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  cli.drop_closed_loop_noise()
  from mdlm_jax.training import checkpoint_eval
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    res = checkpoint_eval.evaluate_checkpoint(_CHECKPOINT.value, _DATA.value, _TEXT_FIELD.value, _NUM_BATCHES.value,
                                              _BATCH_SIZE.value, _TIME_SAMPLES.value, _SEED.value, _RAW.value,
                                              _MESH.value, _PROFILE.value,
                                              seq_len=_SEQ_LEN.value, decode_dtype=_DECODE_DTYPE.value)
  except cli.USER_ERRORS as e:
    cli.fail("eval", e)
  import jax
  from mdlm_jax.training import evaluation
  if jax.process_index() != 0:
    return
  if _JSON.value:
    print(json.dumps(res))
  else:
    print(f"{res['objective']} step {res['step']} ({res['params']} params, {res['decode_dtype']} weights)"
          f" on {res['data']}: "
          f"{evaluation.describe(res)}")
    if "profile" in res:
      print(evaluation.describe_profile(res["profile"]))


if __name__ == "__main__":
  app.run(main)
