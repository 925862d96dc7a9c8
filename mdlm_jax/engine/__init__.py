"""Serving's device work: continuous batching over fixed slots (`Engine`),
each slot a request at its own point of block-by-block diffusion decoding
against its own row of one KV cache (`slots`), with prompts prefilled whole
or in chunks, grammar-constrained rows and per-token log-probabilities."""

from mdlm_jax.engine.engine import (ContextLengthExceeded, Engine, EngineClosed, Event, Handle, QueueFull,
                                    Request)
from mdlm_jax.engine.slots import SlotConfig, Slots

__all__ = ["ContextLengthExceeded", "Engine", "EngineClosed", "Event", "Handle", "QueueFull", "Request",
           "SlotConfig", "Slots"]
