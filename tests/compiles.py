"""Counting XLA compilations through JAX's public monitoring events, so a
test can say "this call compiled nothing" without JAX's private caches."""

from __future__ import annotations

import contextlib

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_active: list[list[str]] = []


def _listen(event: str, duration: float, **kwargs) -> None:
  if event == _EVENT:
    for names in _active:
      names.append(str(kwargs.get("fun_name", "")))


monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def compilations():
  """Yields a list that receives the name of every program compiled in the block."""
  names: list[str] = []
  _active.append(names)
  try:
    yield names
  finally:
    _active.remove(names)
