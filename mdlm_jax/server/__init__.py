"""The OpenAI-compatible HTTP API over an `engine.Engine` (`create_app`):
chat with templates, tools and structured outputs, completions,
fill-in-the-middle, apply-edit, streamed drafts, /health, /metrics and the
playground page. `create_app` and `Limits` load the web stack on first use."""

__all__ = ["create_app", "Limits"]


def __getattr__(name):
  if name == "create_app":
    from mdlm_jax.server.app import create_app
    return create_app
  if name == "Limits":
    from mdlm_jax.server.protocol import Limits
    return Limits
  raise AttributeError(f"module 'mdlm_jax.server' has no attribute {name!r}")
