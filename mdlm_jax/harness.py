"""lm-evaluation-harness adapter: the model `mdlm_jax`.

    python -m mdlm_jax.harness --model mdlm_jax \
        --model_args checkpoint=DIR,mc_samples=32,effort=medium --tasks TASKS [any lm_eval flag]

runs lm_eval's own command line with this model registered (importing this
module registers it for `lm_eval.simple_evaluate(model="mdlm_jax", ...)`) and
the offline tasks in `harness_tasks/` (`pycode_ppl`, `pycode_next_line`).

- `loglikelihood`: exact for AR checkpoints; for diffusion checkpoints the
  conditional NELBO of the continuation with the context in view, as
  LLaDA's evaluation estimates it, averaged over `mc_samples` stratified
  times and seeded masks (`training.evaluation.Scorer`): a lower bound on
  the log-likelihood, the same for the same `seed`. `is_greedy` is whether
  greedy decoding of the context (AR: the argmax at every position;
  diffusion: the engine at temperature 0 and `effort`) gives the
  continuation.
- `loglikelihood_rolling`: lm_eval's disjoint rolling windows of at most
  `max_length` tokens, each scored as above given the window before it.
- `generate_until`: AR checkpoints through the KV-cached generator, diffusion
  checkpoints through the serving engine (`slots` requests decode together)
  at the `effort` preset; `until` are stop strings, `max_gen_toks` and
  `temperature` / `do_sample` are honoured, and any other generation
  argument is an error rather than ignored.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

GEN_KWARGS = ("until", "max_gen_toks", "temperature", "do_sample")
# Offline tasks over held-out standard-library source (pycode_ppl, pycode_next_line).
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_tasks")


@register_model("mdlm_jax")
class MDLMJaxLM(LM):
  """A checkpoint of this project (training workdir, checkpoint or
  params-only folder; default: the packaged model) for lm_eval."""

  def __init__(self, checkpoint: str | None = None, mc_samples: int = 16, seed: int = 0, effort: str = "medium",
               batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = 256, slots: int = 8,
               max_batch_size: int | None = None, device: str | None = None):
    super().__init__()
    import jax
    from mdlm_jax import checkpoints
    from mdlm_jax.checkpoints import packaged
    from mdlm_jax.sampling import presets
    from mdlm_jax.training.evaluation import Scorer
    backend = jax.default_backend()
    if device is not None and device.split(":")[0] not in (backend, "cuda" if backend == "gpu" else backend):
      # lm_eval's command line always sends a device (cuda:0 by default): JAX
      # places the model on its own default backend, chosen by JAX_PLATFORMS.
      print(f"mdlm_jax: device={device!r} does not apply; JAX runs on {backend!r} (set JAX_PLATFORMS to choose)",
            file=sys.stderr)
    if str(batch_size).startswith("auto"):
      raise ValueError("batch_size=auto is not supported: give the number of rows scored together")
    self.batch_size = int(batch_size) if max_batch_size is None else min(int(batch_size), int(max_batch_size))
    for name, value in (("mc_samples", int(mc_samples)), ("batch_size", self.batch_size),
                        ("max_gen_toks", int(max_gen_toks)), ("slots", int(slots))):
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if effort not in presets.EFFORTS:
      raise ValueError(f"effort must be one of {presets.EFFORTS}, got {effort!r}")
    self.loaded = checkpoints.load(checkpoint or packaged.path())
    self.tok = self.loaded.tokenizer
    self.causal = bool(self.loaded.spec.cfg.causal)
    self.max_length = int(max_length or self.loaded.config.data.seq_len)
    self.seed, self.effort, self.max_gen_toks, self.slots = int(seed), effort, int(max_gen_toks), int(slots)
    self.scorer = Scorer.for_model(self.loaded, time_samples=int(mc_samples), seed=self.seed)
    self._engine = self._ar = self._argmax = None

  # -- loglikelihood ----------------------------------------------------------

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids with BOS, continuation ids), split where lm_eval's HF
    models split: trailing spaces go with the continuation, and the pair is
    encoded whole so the boundary tokenizes as in running text."""
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = self.tok.encode(context + continuation)
    ctx = self.tok.encode(context) if context else []
    return [self.tok.bos_id] + whole[:len(ctx)], whole[len(ctx):]

  def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> np.ndarray:
    """Log-likelihood (or its bound) of each continuation given its context,
    the row cut to its last max_length tokens; rows of like length batched."""
    out = np.zeros(len(pairs))
    rows = [(ctx + cont)[-self.max_length:] for ctx, cont in pairs]
    context = [max(len(r) - len(cont), 0) for r, (_, cont) in zip(rows, pairs)]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for lo in range(0, len(order), self.batch_size):
      idx = order[lo:lo + self.batch_size]
      nll, _ = self.scorer([rows[i] for i in idx], [context[i] for i in idx])
      out[idx] = -nll
    return out

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    pairs = [self.encode_pair(*r.args) for r in requests]
    if any(not cont for _, cont in pairs):
      raise ValueError("a loglikelihood request has an empty continuation")
    ll = self.score_pairs(pairs)
    greedy = self._greedy_ar(pairs) if self.causal else self.greedy_diffusion(pairs)
    return [(float(a), bool(b)) for a, b in zip(ll, greedy)]

  def _greedy_ar(self, pairs) -> list[bool]:
    if self._argmax is None:  # compiled once per row width, not once per call
      import jax
      import jax.numpy as jnp
      from mdlm_jax.model.spec import bind
      spec = self.loaded.spec
      self._argmax = jax.jit(lambda params, tokens: jnp.argmax(bind(spec, params)(tokens), axis=-1))
    argmax = self._argmax
    out = []
    for ctx, cont in pairs:
      row = (ctx + cont)[-self.max_length:]
      width = -(-len(row) // 64) * 64
      tokens = np.full((1, width), self.tok.pad_id, np.int32)
      tokens[0, :len(row)] = row
      pred = np.asarray(argmax(self.loaded.params, tokens))[0]
      start = len(row) - len(cont)
      out.append(bool(np.array_equal(pred[start - 1:len(row) - 1], np.asarray(cont))))
    return out

  def greedy_diffusion(self, pairs) -> list[bool]:
    """Whether the engine's greedy decoding of each context starts with the
    continuation's tokens (read back from its log-probability entries)."""
    from mdlm_jax.engine.engine import Request
    room = self.max_length - max(len(cont) for _, cont in pairs)
    engine = self.engine_for(room, max(len(cont) for _, cont in pairs))
    sampler = engine.sampler_for(self.effort, temperature=0.0)
    handles = [engine.submit(Request(ctx[-room:], len(cont), sampler, seed=self.seed, logprobs=0))
               for ctx, cont in pairs]
    out = []
    for h, (_, cont) in zip(handles, pairs):
      ids = [entry[0] for ev in h.events(timeout=3600) for entry in (ev.logprobs or [])]
      out.append(ids[:len(cont)] == list(cont))
    return out

  def loglikelihood_rolling(self, requests) -> list[float]:
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    out = []
    for r in requests:
      (text,) = r.args
      windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
          self.tok.encode(text), prefix_token=self.tok.bos_id, max_seq_len=self.max_length, context_len=1)]
      out.append(float(self.score_pairs([(list(c), list(x)) for c, x in windows]).sum()))
    return out

  # -- generation -------------------------------------------------------------

  def generate_until(self, requests) -> list[str]:
    groups: dict[tuple, list[int]] = {}
    prompts = []
    for i, r in enumerate(requests):
      context, kwargs = r.args
      kwargs = dict(kwargs or {})
      unknown = sorted(set(kwargs) - set(GEN_KWARGS))
      if unknown:
        raise ValueError(f"generate_until: unsupported generation arguments {unknown}; mdlm_jax takes {GEN_KWARGS}")
      until = kwargs.get("until") or []
      until = (until,) if isinstance(until, str) else tuple(until)
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", True) else 0.0
      n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
      if n < 1:
        raise ValueError(f"generate_until: max_gen_toks must be >= 1, got {n}")
      prompts.append([self.tok.bos_id] + self.tok.encode(context))
      groups.setdefault((n, until, temperature), []).append(i)
    out: list[str] = [""] * len(requests)
    for (n, until, temperature), idx in groups.items():
      for i, text in zip(idx, self._generate([prompts[i] for i in idx], n, until, temperature)):
        out[i] = text
    return out

  def _generate(self, prompts: list[list[int]], n: int, stop: tuple[str, ...], temperature: float) -> list[str]:
    """Each prompt's completion of at most n tokens, cut at its first stop
    string; prompts keep their last max_length - n tokens."""
    room = self.max_length - n
    if room < 1:
      raise ValueError(f"max_gen_toks={n} leaves no room for a prompt in max_length={self.max_length}")
    prompts = [p[-room:] for p in prompts]
    if self.causal:
      return self._generate_ar(prompts, n, stop, temperature)
    from mdlm_jax.engine.engine import Request
    engine = self.engine_for(room, n)
    sampler = engine.sampler_for(self.effort, temperature=temperature)
    handles = [engine.submit(Request(p, n, sampler, seed=self.seed, stop=stop)) for p in prompts]
    return [h.result(timeout=3600).text for h in handles]

  def engine_for(self, max_prompt: int, max_tokens: int):
    """The engine, rebuilt larger when a request outgrows it."""
    from mdlm_jax.engine.engine import Engine
    from mdlm_jax.sampling import presets
    bs = presets.block_size_for(self.loaded.config.diffusion.block_size)
    new = -(-max(max_tokens, self.max_gen_toks) // bs) * bs
    e = self._engine
    if e is None or e.sc.max_prompt < max_prompt or e.sc.max_new_tokens < new:
      if e is not None:
        e.close(deadline_s=0)
      self._engine = e = Engine(self.loaded, num_slots=self.slots, max_prompt=max(max_prompt, self.max_length),
                                max_new_tokens=new, max_queue=1 << 20).start()
    return e

  def _generate_ar(self, prompts: list[list[int]], n: int, stop: tuple[str, ...], temperature: float) -> list[str]:
    """The AR sampler on token rows (left-padded, as ARGenerator lays them out)."""
    import jax
    import jax.numpy as jnp
    from mdlm_jax.sampling.ar import ARSampler
    from mdlm_jax.sampling.finish import finish
    from mdlm_jax.model.spec import for_decoding
    if self._ar is None:
      self._ar = for_decoding(self.loaded, None)
    sampler = ARSampler(n, temperature=temperature)
    out = []
    for lo in range(0, len(prompts), self.batch_size):
      chunk = prompts[lo:lo + self.batch_size]
      width = max(16, -(-max(len(p) for p in chunk) // 16) * 16)
      tokens = np.full((len(chunk), width), self.tok.pad_id, np.int32)
      valid = np.zeros((len(chunk), width), bool)
      for r, row in enumerate(chunk):
        tokens[r, width - len(row):], valid[r, width - len(row):] = row, True
      res = jax.device_get(sampler.generate(self._ar.spec, self._ar.params, jnp.asarray(tokens), jnp.asarray(valid),
                                            jax.random.PRNGKey(self.seed + lo), eos_id=self.tok.eos_id,
                                            pad_id=self.tok.pad_id))
      out += [finish(self.tok, res["tokens"][r], max_tokens=n, stop=stop).text for r in range(len(chunk))]
    return out

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close(deadline_s=0)
      self._engine = None


def main(argv: Sequence[str] | None = None) -> Any:
  """lm_eval's command line, with `--model mdlm_jax` and, unless
  --include_path names another folder, this package's offline tasks."""
  from lm_eval.__main__ import cli_evaluate
  argv = list(sys.argv[1:] if argv is None else argv)
  if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
    argv += ["--include_path", TASKS_DIR]
  sys.argv = [sys.argv[0], *argv]
  return cli_evaluate()


if __name__ == "__main__":
  main()
