"""The CPU kernels built with extra compiler flags (the paths for CPUs
without AVX-512 or VNNI), each flag set compiled once a test process: a
build takes about 11 s, and seven tests read two builds."""

import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import int8

# The tests that read such a build run in one worker (`--dist loadgroup`), so it is compiled once.
BUILDS_GROUP = pytest.mark.xdist_group("cpu_kernel_builds")


@pytest.fixture(scope="session")
def kernels_built_with(tmp_path_factory):
  """`build(flags)`: the path of the kernels' library compiled with `flags`
  into a cache of this session's own (skips where no compiler is found)."""
  built = {}

  def build(flags: tuple[str, ...]) -> str:
    if not kernels.native_kernel_ready():
      pytest.skip("no C++ compiler on this machine")
    if flags not in built:
      with pytest.MonkeyPatch.context() as m:
        m.setenv("MDLM_JAX_CACHE", str(tmp_path_factory.mktemp("kernels")))
        built[flags] = int8._build(flags)
    return built[flags]
  return build
