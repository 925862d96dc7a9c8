"""Sampling speed and quality: every effort preset of a diffusion checkpoint
against its AR twin, on held-out validation code; a ~100M-parameter
memory-bound shape; and transformers' AR generate() when it is installed.

  python -m mdlm_jax.bench sample --mdlm=DIR --ar=DIR [--json] [--out=F.json] [--png=F.png]

Speeds are measured after a compile run of the same shapes, each the fastest
of --repeats runs (outputs are deterministic; a shared machine's speed
drifts, and the fastest run is the least disturbed one). Quality: the AR
twin's per-token NLL of the generated text given the prompt (gen-PPL); the
fraction of prompt+completion texts whose complete lines are valid Python so
far (`parses`); and the share of the completions' lines that repeat an
earlier line of the same completion. The same figures for the held-out code
that follows each prompt ("reference") say what real code scores. The AR twin runs in both
weight layouts and the faster is its figure ("ar"): the baseline is never
held to the diffusion default.
"""

from __future__ import annotations

import argparse
import codeop
import json
import math
import sys
import time
import warnings

from mdlm_jax.bench.common import add_output_flags, finish, positive_ints, save_figure
from mdlm_jax.model.layers import WEIGHT_LAYOUTS


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench sample")
  p.add_argument("--mdlm", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--ar", default=None, help="AR twin checkpoint (default: the packaged AR twin)")
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--batch-sizes", default="1,8")
  p.add_argument("--num-prompts", type=int, default=8, help="validation prompts (batch 1 runs use each)")
  p.add_argument("--efforts", default="instant,low,medium,high")
  p.add_argument("--skip-100m", action="store_true", help="skip the 100M-parameter memory-bound shape")
  p.add_argument("--cached-blocks", action="store_true",
                 help="a model trained on whole sequences: also run each effort in cached blocks (rows"
                      " '<effort>_cached'), the approximation that ignores the masked blocks to the right")
  p.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement; the fastest counts")
  p.add_argument("--presence-penalty", type=float, default=0.0,
                 help="OpenAI's presence penalty for every setting, the AR twin's included")
  p.add_argument("--frequency-penalty", type=float, default=0.0,
                 help="OpenAI's frequency penalty for every setting, the AR twin's included")
  add_output_flags(p, "bench_sample.png", "speed-quality plot")
  a = p.parse_args(argv)
  from mdlm_jax.sampling.presets import EFFORTS
  a.batch_sizes = positive_ints(p, "--batch-sizes", a.batch_sizes)
  a.efforts = a.efforts.split(",")
  if a.num_prompts < 1 or a.new_tokens < 1 or a.prompt_tokens < 1 or a.repeats < 1:
    p.error("--num-prompts, --new-tokens, --prompt-tokens and --repeats must be positive")
  for flag, value in (("--presence-penalty", a.presence_penalty), ("--frequency-penalty", a.frequency_penalty)):
    if not -2.0 <= value <= 2.0:
      p.error(f"{flag} must be in [-2, 2], got {value}")
  unknown = [e for e in a.efforts if e not in EFFORTS]
  if unknown:
    p.error(f"unknown --efforts {unknown}; choose from {', '.join(EFFORTS)}")
  return a


def truncate_to_complete_lines(text: str) -> str:
  return text[:text.rfind("\n") + 1] if "\n" in text else ""


def parses(text: str) -> bool:
  """Whether the text's complete lines are Python so far: a whole module, or
  the start of one that later lines could finish (an open block, bracket or
  docstring, as the compiler's incomplete-input mode tells them apart). A
  completion is cut at a token budget, usually inside a block or a
  docstring; a whole-module parse would fail real code cut the same way."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # SyntaxWarnings (escapes) are not errors
    try:
      codeop.compile_command(truncate_to_complete_lines(text), symbol="exec")
      return True
    except (SyntaxError, ValueError, OverflowError):
      return False


def repeated_lines(text: str) -> tuple[int, int]:
  """(lines that repeat an earlier line of the text, lines), over its complete
  non-blank lines, stripped: a greedy loop writes one line again and again."""
  lines = [line.strip() for line in truncate_to_complete_lines(text).splitlines() if line.strip()]
  return len(lines) - len(set(lines)), len(lines)


def validation_examples(loaded, n: int, prompt_tokens: int, continuation_tokens: int = 0
                        ) -> list[tuple[str, list[int]]]:
  """(prompt, continuation) from the first n validation files of at least twice
  `prompt_tokens` tokens: the text of their first `prompt_tokens` tokens, and
  the ids of the (up to) `continuation_tokens` tokens that follow it."""
  from mdlm_jax import data
  c = loaded.config
  docs = data.load_documents(c.data.corpus, "validation", c.data.validation_fraction, c.data.text_field)
  out = []
  for d in docs:
    ids = loaded.tokenizer.encode(d)
    if len(ids) >= prompt_tokens * 2:
      continuation = ids[prompt_tokens:prompt_tokens + continuation_tokens]
      out.append((loaded.tokenizer.decode(ids[:prompt_tokens]), continuation))
    if len(out) == n:
      break
  if not out:
    raise ValueError("no validation document is long enough for the prompt")
  return out


def validation_prompts(loaded, n: int, prompt_tokens: int) -> list[str]:
  """The first `prompt_tokens` tokens of the first n validation files that are long enough."""
  return [p for p, _ in validation_examples(loaded, n, prompt_tokens)]


def reference_quality(examples, tokenizer, scorer) -> dict:
  """The quality figures of the held-out code itself: each prompt's true
  continuation, scored like a completion. A sampler that wrote code like the
  data's would score about this; much lower means text the AR twin finds
  likelier than real code (a weak twin's own greedy text repeats itself)."""
  nll = scored = parsed = 0
  repeats = Repeats()
  for prompt, ids in examples:
    s, k = scorer([tokenizer.bos_id] + tokenizer.encode(prompt), list(ids))
    nll, scored = nll + s, scored + k
    text = tokenizer.decode(list(ids))
    parsed += parses(prompt + text)
    repeats.add(text)
  return {"gen_ppl": math.exp(nll / scored) if scored else float("nan"), "parse_rate": parsed / len(examples),
          "repeated_line_rate": repeats.rate, "new_tokens_mean": scored / len(examples)}


class Repeats:
  """`repeated_lines` pooled over texts: the share of all their lines that
  repeat an earlier line of the same text (nan without lines)."""

  def __init__(self):
    self.repeated = self.lines = 0

  def add(self, text: str) -> None:
    r, n = repeated_lines(text)
    self.repeated, self.lines = self.repeated + r, self.lines + n

  @property
  def rate(self) -> float:
    return self.repeated / self.lines if self.lines else float("nan")


class GenPPL:
  """The AR twin's NLL of completions given their prompts (`evaluation.Scorer`)."""

  def __init__(self, ar_loaded):
    from mdlm_jax.diffusion.objectives import ARObjective
    from mdlm_jax.training.evaluation import Scorer
    self._scorer = Scorer(ar_loaded.spec, ARObjective(), ar_loaded.params)

  def __call__(self, prompt_ids: list[int], completion_ids: list[int]) -> tuple[float, int]:
    nll, count = self._scorer([list(prompt_ids) + list(completion_ids)], context=[len(prompt_ids)])
    return float(nll[0]), int(count[0])


def fastest(run, repeats: int):
  """(seconds, result) of the fastest of `repeats` calls of run()."""
  best = None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = run()
    dt = time.perf_counter() - t0
    if best is None or dt < best[0]:
      best = (dt, out)
  return best


def run_setting(gen, prompts, batch, new_tokens, sampler, scorer, repeats: int = 1, **kw):
  """Compiles, then times every batch of prompts (fastest of `repeats`); returns speed and quality."""
  batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
  batches = [b for b in batches if len(b) == batch] or [prompts[:1] * batch]
  # Compiled for every batch's prompt lengths first: the diffusion generator's
  # program has the prompt's exact length, so a new length compiled inside a
  # timed run (a few seconds in a run of a fraction of one).
  shapes = {}
  for b in batches:
    shapes.setdefault(tuple(len(gen.encode_prompt(p)) for p in b), b)
  for b in shapes.values():
    gen.generate(b, max_new_tokens=new_tokens, sampler=sampler, **kw)
  tokens = passes = 0
  seconds, latencies, nll, scored, parsed, n = 0.0, [], 0.0, 0, 0, 0
  lines = Repeats()
  for b in batches:
    dt, r = fastest(lambda b=b: gen.generate(b, max_new_tokens=new_tokens, sampler=sampler, **kw), repeats)
    seconds += dt
    latencies.append(dt)
    passes += r.forward_passes
    for p, c in zip(b, r.completions):
      tokens += len(c.tokens)
      n += 1
      parsed += parses(p + c.text)
      lines.add(c.text)
      if c.tokens:
        s, k = scorer(gen.encode_prompt(p), c.tokens)
        nll, scored = nll + s, scored + k
  return {"tokens_per_s": tokens / seconds, "tokens_per_forward": tokens / max(passes, 1) / batch,
          "latency_s": sum(latencies) / len(latencies), "new_tokens_mean": tokens / n,
          "gen_ppl": math.exp(nll / scored) if scored else float("nan"), "parse_rate": parsed / n,
          "repeated_line_rate": lines.rate, "forward_passes_mean": passes / len(batches)}


MEMORY_BOUND_SHAPE = dict(vocab_size=32000, num_layers=12, embed_dim=768, num_heads=12, mlp_dim=2048)


def memory_bound_shape(new_tokens: int, prompt_tokens: int, repeats: int = 1, shape: dict | None = None) -> dict:
  """~100M parameters (`shape`: ModelConfig fields), random weights, batch 1:
  diffusion committing exactly 4 tokens per pass (KV-cached blocks) against
  KV-cached AR decoding."""
  import jax
  import ml_collections
  from mdlm_jax import config as config_lib
  from mdlm_jax.parallel import sharding
  from mdlm_jax.checkpoints.loading import LoadedModel
  from mdlm_jax.model.spec import init_params, model_spec
  from mdlm_jax.model import ModelConfig
  from mdlm_jax.sampling.ar import ARSampler
  from mdlm_jax.sampling.generate import ARGenerator, Generator
  from mdlm_jax.sampling.samplers import LowConfidenceSampler
  dims = shape or MEMORY_BOUND_SHAPE

  class Tok:  # ids only; no text is decoded for speed runs
    vocab_size, mask_id, bos_id, eos_id, pad_id, unk_id, adds_bos = dims["vocab_size"], 4, 1, 2, 3, 0, True

    def piece_id(self, piece):
      raise ValueError(f"no piece {piece!r}")

    def encode(self, text):
      return [5 + (ord(ch) % 1000) for ch in text]

    def decode(self, ids):
      return ""

  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
  prompt = ["x" * (prompt_tokens - 1)]
  # Both commit exactly 4 tokens per pass: blocks of 8 in 2 steps, or blocks of
  # 4 in one step (each pass then carries 8 tokens: the finished block and the
  # next). A pass costs more with every token it carries on a CPU.
  settings = {"diffusion_block8_2steps": LowConfidenceSampler(steps=2, block_size=8, kv_cache=True),
              "diffusion_block4_1step": LowConfidenceSampler(steps=1, block_size=4, kv_cache=True)}
  out = {}
  for causal in (False, True):
    cfg = ModelConfig(**dims, causal=causal)
    spec = model_spec(cfg, mesh)
    config = config_lib.base_config()  # a complete config, as every loaded model has
    config.objective = "ar" if causal else "mdlm"
    loaded = LoadedModel(spec, init_params(spec, 0), Tok(), config, 0, False)
    n_params = sum(x.size for x in jax.tree.leaves(loaded.params))
    ar = ARSampler(new_tokens, temperature=0.0)
    runs = {f"ar_{layout}": (ARGenerator(loaded, weight_layout=layout), ar) for layout in WEIGHT_LAYOUTS} if causal \
        else {name: (Generator(loaded), sampler) for name, sampler in settings.items()}
    for name, (gen, sampler) in runs.items():
      gen.generate(prompt, max_new_tokens=new_tokens, sampler=sampler)
      dt, r = fastest(lambda gen=gen, sampler=sampler: gen.generate(prompt, max_new_tokens=new_tokens,
                                                                  sampler=sampler), repeats)
      produced = len(r.completions[0].tokens) or new_tokens
      out[name] = {"params": int(n_params), "tokens_per_s": produced / dt, "forward_passes": r.forward_passes,
                   "tokens": produced, "seconds": dt, "ms_per_pass": 1000 * dt / r.forward_passes}
  out["ar"] = fastest_layout(out)
  for name in settings:
    out[name]["speedup_vs_ar"] = out[name]["tokens_per_s"] / out["ar"]["tokens_per_s"]
  out["diffusion_speedup"] = max(out[name]["speedup_vs_ar"] for name in settings)
  return out


def fastest_layout(rows: dict) -> dict:
  """The AR baseline: its faster weight layout (one row per pass reads either
  at about the same speed, so the project's default is not assumed to suit it)."""
  best = max(WEIGHT_LAYOUTS, key=lambda layout: rows[f"ar_{layout}"]["tokens_per_s"])
  return {**rows[f"ar_{best}"], "weight_layout": best}


def transformers_peer(new_tokens: int, prompt_tokens: int, repeats: int = 1) -> dict:
  """Hugging Face transformers' AR generate() with KV cache, a 20M Llama shape, batch 1."""
  try:
    import torch
    import transformers
  except ImportError:
    return {"absent": "torch/transformers are not installed (reference: 75 tok/s measured on this CPU)"}
  cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                 num_attention_heads=6, max_position_embeddings=1024)
  model = transformers.LlamaForCausalLM(cfg).eval()
  ids = torch.randint(5, 4096, (1, prompt_tokens))
  kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
  with torch.no_grad():
    model.generate(ids, **kw)
    dt, _ = fastest(lambda: model.generate(ids, **kw), repeats)
  return {"tokens_per_s": new_tokens / dt, "params": sum(p.numel() for p in model.parameters()),
          "torch": torch.__version__, "transformers": transformers.__version__}


def plot(result: dict, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(result["batches"]), figsize=(6 * len(result["batches"]), 4.2), dpi=110,
                           squeeze=False)
  for ax, (batch, rows) in zip(axes[0], result["batches"].items()):
    for name, r in rows.items():
      if name.startswith("ar_"):  # a layout of the AR baseline; "ar" is the faster
        continue
      marker = "s" if name == "ar" else "o"
      ax.scatter(r["tokens_per_s"], r["gen_ppl"], marker=marker, s=50)
      ax.annotate(f"{name} ({r['tokens_per_forward']:.1f} tok/pass)", (r["tokens_per_s"], r["gen_ppl"]),
                  textcoords="offset points", xytext=(5, 5), fontsize=8)
    if "reference" in result:
      ax.axhline(result["reference"]["gen_ppl"], linestyle="--", color="gray", linewidth=1)
      ax.annotate("held-out code", (ax.get_xlim()[0], result["reference"]["gen_ppl"]), textcoords="offset points",
                  xytext=(4, 4), fontsize=8, color="gray")
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("gen-PPL under the AR twin (lower is better)")
    ax.set_title(f"batch {batch}")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  save_figure(fig, path)


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  from mdlm_jax import cli
  from mdlm_jax import checkpoints
  from mdlm_jax.checkpoints import packaged
  from mdlm_jax.sampling.ar import ARSampler
  from mdlm_jax.sampling.generate import ARGenerator, Generator
  from mdlm_jax.sampling import presets
  try:
    mdlm = checkpoints.load(a.mdlm or packaged.path(packaged.DIFFUSION))
    ar = checkpoints.load(a.ar or packaged.path(packaged.AR))
    if mdlm.tokenizer.to_bytes() != ar.tokenizer.to_bytes():
      raise ValueError("the diffusion checkpoint and the AR twin use different tokenizers")
    examples = validation_examples(mdlm, a.num_prompts, a.prompt_tokens, a.new_tokens)
    if a.cached_blocks and mdlm.config.diffusion.block_size > 0:
      raise ValueError(f"--cached-blocks compares exact and cached decoding of a model trained on whole"
                       f" sequences; this one is a BD3-LM model (blocks of {mdlm.config.diffusion.block_size}),"
                       f" which cached blocks decode exactly")
  except cli.USER_ERRORS as e:
    cli.fail("bench sample", e)
  prompts = [p for p, _ in examples]
  scorer = GenPPL(ar)
  dgen = Generator(mdlm)
  agens = {layout: ARGenerator(ar, weight_layout=layout) for layout in WEIGHT_LAYOUTS}
  block = mdlm.config.diffusion.block_size
  result = {"bench": "sample", "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
            "num_prompts": len(prompts), "repeats": a.repeats, "mdlm_step": mdlm.step, "ar_step": ar.step,
            "presence_penalty": a.presence_penalty, "frequency_penalty": a.frequency_penalty,
            "reference": reference_quality(examples, mdlm.tokenizer, scorer), "batches": {}}
  print(f"held-out continuations: {json.dumps(result['reference'])}", file=sys.stderr, flush=True)
  for batch in a.batch_sizes:
    rows = {}
    for effort, cached in [(e, c) for e in a.efforts for c in ((False, True) if a.cached_blocks else (None,))]:
      extra = {} if cached is None else {"kv_cache": cached}
      sampler = presets.for_model(effort, block, presence_penalty=a.presence_penalty,  # what the effort means
                                  frequency_penalty=a.frequency_penalty,  # everywhere
                                  in_order=mdlm.spec.cfg.clean_causal, **extra)
      timed = run_setting(dgen, prompts, batch, a.new_tokens, sampler, scorer, repeats=a.repeats)
      name = effort + ("_cached" if cached else "")
      rows[name] = {"sampler": repr(sampler), **timed}
      print(f"batch {batch} {name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    ar_sampler = ARSampler(a.new_tokens, temperature=0.0, presence_penalty=a.presence_penalty,
                           frequency_penalty=a.frequency_penalty)
    for layout, agen in agens.items():
      rows[f"ar_{layout}"] = run_setting(agen, prompts, batch, a.new_tokens, ar_sampler, scorer, repeats=a.repeats)
    rows["ar"] = fastest_layout(rows)
    print(f"batch {batch} ar: {json.dumps(rows['ar'])}", file=sys.stderr, flush=True)
    result["batches"][str(batch)] = rows
  if not a.skip_100m:
    result["memory_bound_100m"] = memory_bound_shape(a.new_tokens, a.prompt_tokens, a.repeats)
  result["transformers_peer"] = transformers_peer(a.new_tokens, a.prompt_tokens, a.repeats)
  finish(result, a, plot)


if __name__ == "__main__":
  main(sys.argv[1:])
