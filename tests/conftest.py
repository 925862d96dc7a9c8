"""Test setup: four host CPU devices so sharded code runs on one machine."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run in several worker processes (setup.cfg): on an accelerator they
# share its memory, so none may claim most of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The suite's programs are small and run briefly, so compiling them is most of
# a test's time: LLVM's optimisation of the code took about a quarter of the
# whole run (628 s -> 476 s, measured), and XLA:CPU's MLIR fusion emitters
# about 30% of what was left (the whole run 658 s -> 463 s on 2 cores; the
# classic emitters compile the same fusions). MDLM_TEST_XLA_OPTIMIZE=1 compiles as
# users' programs compile.
COMPILE_FLAGS = ("" if os.environ.get("MDLM_TEST_XLA_OPTIMIZE") == "1"
                 else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a CLI or server a test starts: `devices` host devices,
  its programs compiled as the suite's are."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}".strip()


flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=4"
for flag in COMPILE_FLAGS.split():
  if flag.partition("=")[0] not in flags:
    flags += " " + flag
os.environ["XLA_FLAGS"] = flags.strip()

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name: str):
  from mdlm_jax.config import load_config_file
  return load_config_file(os.path.join(REPO, "configs", f"{name}.py"))


def _once_per_run(tmp_path_factory, worker_id: str, name: str, make):
  """`make(folder)` run once for the whole test run, its JSON result shared by
  every xdist worker through a file lock, so N workers do not train the same
  tiny models N times. The folders it fills are read-only to the tests."""
  import json
  import shutil

  import filelock
  if worker_id == "master":  # no xdist
    return make(tmp_path_factory.mktemp(name))
  root = tmp_path_factory.getbasetemp().parent  # one folder per run, shared by its workers
  done = root / f"{name}.json"
  with filelock.FileLock(str(root / f"{name}.lock")):
    if not done.is_file():
      folder = root / name
      shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed here left
      folder.mkdir()
      done.write_text(json.dumps(make(folder)))
    return json.loads(done.read_text())


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_for_the_run(tmp_path_factory, worker_id):
  """XLA's disk cache in a folder of this run's own, shared by its workers and the
  servers and CLIs they start: many tests compile the same small programs, and a
  program compiled once is loaded after (a tenth of the engine and server tests'
  time, measured).
  A fresh folder each run, so nothing compiled by other code is ever read back. A
  cache the caller set (JAX_COMPILATION_CACHE_DIR) is left as it is."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  root = tmp_path_factory.getbasetemp()
  folder = str((root if worker_id == "master" else root.parent) / "xla_cache")
  settings = {"jax_compilation_cache_dir": folder, "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": -1}
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  for name, value in settings.items():
    os.environ[name.upper()] = str(value)  # for the subprocesses
    jax.config.update(name, value)
  compilation_cache.reset_cache()  # a program compiled while collecting would have settled "no cache"


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory, worker_id):
  """One small sentencepiece model on stdlib text, shared by the training tests."""
  def make(folder):
    from mdlm_jax import data
    from mdlm_jax.data.tokenizer import train_tokenizer
    path = str(folder / "tiny.model")
    train_tokenizer(data.load_documents("stdlib", "train", 0.05), path, vocab_size=512, max_chars=1_000_000)
    return path
  return _once_per_run(tmp_path_factory, worker_id, "tok", make)


@pytest.fixture
def tiny_config(tiny_tokenizer_path):
  c = load_config("tiny")
  c.data.tokenizer = tiny_tokenizer_path
  return c


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, worker_id, tiny_tokenizer_path):
  """Two-step tiny training runs, {"mdlm": workdir, "ar": workdir}, for the
  tests that only need some trained checkpoint to read."""
  def make(folder):
    from mdlm_jax.training import trainer
    out = {}
    for objective in ("mdlm", "ar"):
      c = load_config("tiny")
      c.data.tokenizer = tiny_tokenizer_path
      c.objective, c.model.causal = objective, objective == "ar"
      c.train.update(num_steps=2, checkpoint_every=2, log_every=1, eval_batches=1)
      out[objective] = str(folder / objective)
      trainer.train(c, out[objective])
    return out
  return _once_per_run(tmp_path_factory, worker_id, "tiny_checkpoints", make)


def adapted_from(ar, *, lora_rank: int = 4, block_size: int = 2):
  """An AR checkpoint (`checkpoints.load`ed) made an adapted model: a causal clean stream, a
  shifted head and random adapters on the noisy rows, its base weights unchanged."""
  import dataclasses

  import jax
  import numpy as np

  from mdlm_jax.model.spec import model_spec
  cfg = dataclasses.replace(ar.spec.cfg, causal=False, shift_logits=True, clean_causal=True, lora_rank=lora_rank)
  spec = model_spec(cfg, None)
  rng = np.random.default_rng(0)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(ar.params)[0]}
  leaves = [flat.get(jax.tree_util.keystr(k), 0.05 * rng.standard_normal(a.shape).astype(np.float32))
            for k, a in jax.tree_util.tree_flatten_with_path(spec.abstract)[0]]
  params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(spec.abstract),
                                        [jax.numpy.asarray(x) for x in leaves])
  config = ar.config.copy_and_resolve_references()
  config.objective, config.diffusion.block_size = "mdlm", block_size
  config.model.update(causal=False, shift_logits=True, clean_causal=True, lora_rank=lora_rank)
  return dataclasses.replace(ar, spec=spec, params=params, config=config)
