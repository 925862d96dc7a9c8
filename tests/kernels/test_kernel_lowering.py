"""Every Pallas kernel lowers for the accelerators on any machine.

The interpreter tests check the kernels' arithmetic, not that the Triton
(GPU) or Mosaic (TPU) lowering accepts them: a primitive with no lowering
there fails only on the accelerator. Exporting for a platform lowers the
kernel to its custom call without one, so a CPU run catches it."""

import jax
import jax.numpy as jnp
import pytest
from jax import export

from mdlm_jax import kernels
from mdlm_jax.kernels import HeadSettings

PLATFORMS = {"gpu": ("cuda", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


def lower(fn, backend, *args):
  platform, target = PLATFORMS[backend]
  exported = export.export(jax.jit(fn), platforms=(platform,),
                           disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
  assert target in exported.mlir_module(), f"no {target} call: the kernel did not lower as a kernel"


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_confidence_head_lowers(backend, temperature):
  hidden = jax.ShapeDtypeStruct((2, 40, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16)
  bits = jax.ShapeDtypeStruct((2, 40, 1000), jnp.uint32)
  st = HeadSettings(temperature, (3, 17))
  lower(lambda h, w, bits: kernels.confidence_head_pallas(h, w, bits, st, backend=backend), backend, hidden, w, bits)


# The TPU variant of flash attention asks the device for its generation while
# lowering, so it lowers only on a TPU.
@pytest.mark.parametrize("backend", ["gpu"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_lowers_forward_and_backward(backend, causal):
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    return kernels.flash_attention(q, k, v, None, causal=causal, backend=backend).astype(jnp.float32).sum()

  lower(jax.grad(loss, argnums=(0, 1, 2)), backend, q, kv, kv)
