"""Serving's device work: continuous batching over fixed slots (`Engine`),
each slot a request at its own point of block-by-block diffusion decoding
against its own row of one KV cache (`slots`), with prompts prefilled whole
or in chunks, grammar-constrained rows and per-token log-probabilities.
`requests` holds what it is asked and answers, `handle` a submitted request
as its caller holds it, `scheduling` the turn's decisions (pass sizes, prompt
buckets, shared prefills), `publishing` what a pass's new state means to each
caller (drafts, kept text, the end), `turns` one turn as data and its
encoding for the other processes of a multi-host server."""

from mdlm_jax.engine.engine import Engine
from mdlm_jax.engine.handle import Handle
from mdlm_jax.engine.requests import ContextLengthExceeded, EngineClosed, Event, QueueFull, Request
from mdlm_jax.engine.slots import SlotConfig, Slots

__all__ = ["ContextLengthExceeded", "Engine", "EngineClosed", "Event", "Handle", "QueueFull", "Request",
           "SlotConfig", "Slots"]
