"""Each package says in its __init__'s docstring what it owns, and the names it
re-exports exist."""

import importlib
import pkgutil

import pytest

import mdlm_jax

# kernels/ sits at the top level and installs as mdlm_jax.kernels.
PACKAGES = sorted({m.name for m in pkgutil.iter_modules(mdlm_jax.__path__, "mdlm_jax.") if m.ispkg
                   and not m.name.endswith(("assets", "harness_tasks"))} | {"mdlm_jax.kernels"})


def test_the_packages_are_the_regrouped_ones():
  names = {p.split(".")[-1] for p in PACKAGES}
  assert {"model", "diffusion", "data", "checkpoints", "training", "parallel", "sampling", "engine", "server",
          "bench", "kernels"} <= names


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_documents_and_exports(name):
  pkg = importlib.import_module(name)
  assert pkg.__doc__ and len(pkg.__doc__.split()) >= 8, f"{name} says nothing of what it owns"
  for public in getattr(pkg, "__all__", []):
    assert getattr(pkg, public, None) is not None, f"{name}.{public} is exported but missing"
