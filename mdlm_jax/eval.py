"""python -m mdlm_jax.eval --checkpoint=DIR [--data=PATH] [--profile=8] [--json]

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
from mdlm_jax.parallel import distributed

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "workdir, checkpoints/ folder or step folder")
_DATA = flags.DEFINE_string("data", None, "folder, glob or .jsonl to evaluate on (default: validation split)")
_TEXT_FIELD = flags.DEFINE_string("text_field", None, "jsonl text field (default: the training config's)")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", None, "batches to evaluate (default: config.eval.num_batches)")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "sequences per batch (default: config.data.batch_size)")
_TIME_SAMPLES = flags.DEFINE_integer("time_samples", None, "MC samples of t per sequence (MDLM only)")
_SEED = flags.DEFINE_integer("seed", None, "seed of the t/mask draws (default: config.eval.seed)")
_RAW = flags.DEFINE_bool("raw_params", False, "evaluate the raw params instead of the EMA")
_PROFILE = flags.DEFINE_integer("profile", 0, "diffusion only: also the bound's integrand at this many noise"
                                " levels t, and by position in the block (where the bound is lost)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a sentence")
_MESH = flags.DEFINE_string("mesh", None, "device mesh, e.g. 'data=4,fsdp=2' (default: one device, or data"
                            " parallel over every device of a multi-process run)")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = distributed.define_flags()
flags.mark_flag_as_required("checkpoint")


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


def run(checkpoint_path, data_path=None, text_field=None, num_batches=None, batch_size=None,
        time_samples=None, seed=None, raw_params=False, mesh_text=None, profile=0) -> dict:
  from mdlm_jax import data
  from mdlm_jax.training import evaluation
  from mdlm_jax.diffusion import objectives
  from mdlm_jax import checkpoints
  import jax
  mesh = eval_mesh(mesh_text)
  loaded = checkpoints.load(checkpoint_path, mesh=mesh, use_ema=not raw_params)
  c = loaded.config
  text_field = text_field or c.data.text_field
  if data_path:
    docs = data.load_all_documents(data_path, text_field)
  else:
    docs = data.load_documents(c.data.corpus, "validation", c.data.validation_fraction, text_field)
  for name, v in (("num_batches", num_batches), ("batch_size", batch_size), ("time_samples", time_samples)):
    if v is not None and v < 1:
      raise ValueError(f"--{name} must be >= 1, got {v}")
  batch_size = batch_size or c.data.batch_size
  shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
  if batch_size % shards:
    raise ValueError(f"--batch_size={batch_size} does not split over the mesh's {shards} batch shards")
  batches = data.make_eval_batches(docs, loaded.tokenizer, seq_len=c.data.seq_len, batch_size=batch_size,
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
  res.update({"checkpoint": checkpoint_path, "step": loaded.step, "objective": c.objective,
              "data": data_path or f"{c.data.corpus} (validation)",
              "params": "raw" if raw_params or not loaded.has_ema else "ema"})
  return res


def main(argv):
  if len(argv) > 1:
    cli.fail("eval", ValueError(f"unexpected arguments {argv[1:]}"))
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  cli.drop_closed_loop_noise()
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    res = run(_CHECKPOINT.value, _DATA.value, _TEXT_FIELD.value, _NUM_BATCHES.value, _BATCH_SIZE.value,
              _TIME_SAMPLES.value, _SEED.value, _RAW.value, _MESH.value, _PROFILE.value)
  except cli.USER_ERRORS as e:
    cli.fail("eval", e)
  import jax
  from mdlm_jax.training import evaluation
  if jax.process_index() != 0:
    return
  if _JSON.value:
    print(json.dumps(res))
  else:
    print(f"{res['objective']} step {res['step']} ({res['params']} params) on {res['data']}: "
          f"{evaluation.describe(res)}")
    if "profile" in res:
      print(evaluation.describe_profile(res["profile"]))


if __name__ == "__main__":
  app.run(main)
