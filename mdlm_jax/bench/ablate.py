"""The A2D recipe's choices, each trained for the same steps from the same base:

  python -m mdlm_jax.bench ablate [--config=configs/a2d_code_small.py] [--steps 200]
      [--variants recipe,nelbo,...] [--workdir runs/ablate] [--base DIR]
      [--code-prompts 8] [--json] [--out F.json] [--png F.png]

Each variant is the config with a few fields changed (VARIANTS); the
curriculum trains its first stage at blocks of 2 and continues from it. After
the same tokens every variant reports:
- its held-out diffusion bound (NELBO as a perplexity bound, EMA weights) over
  the base's exact perplexity on the same validation batches;
- tokens committed per pass on held-out code completions at `medium`, and
  with revision where the base stays frozen (the text is then the base's),
  at the presets' draft threshold and with every draft offered;
- gen-PPL of those completions under the base and the share that parses;
- its training tokens/s, MFU and wall time.
A variant whose workdir already holds its last step is evaluated, not
retrained (its training figures are those its runs recorded): the same
command resumes an interrupted table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from mdlm_jax.bench.common import add_output_flags, finish, save_figure

# name -> (what it changes, [(share of the steps, {config field: value}), ...]); stages run in turn,
# each from the one before.
VARIANTS = {
    "recipe": ("the config as it is", [(1.0, {})]),
    "nelbo": ("no distillation: the masked-token NELBO alone", [(1.0, {"diffusion.distill_weight": 0.0})]),
    "complementary": ("complementary masks (each row also with its masks swapped: twice the compute)",
                      [(1.0, {"diffusion.complementary_masks": True})]),
    "position": ("position-dependent mask rates (slope 0.5: a block's left in view more often)",
                 [(1.0, {"diffusion.position_mask_slope": 0.5})]),
    "curriculum": ("blocks of 2 for the first half of the steps, then the config's",
                   [(0.5, {"diffusion.block_size": 2}), (0.5, {})]),
    "full": ("every weight trained, no adapters",
             [(1.0, {"train.trainable": "all", "model.lora_rank": 0})]),
    "full+ar": ("every weight trained, plus the AR loss on the clean stream (weight 1)",
                [(1.0, {"train.trainable": "all", "model.lora_rank": 0, "diffusion.ar_weight": 1.0})]),
}


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench ablate", description=__doc__.split("\n\n")[1])
  p.add_argument("--config", default=None, help="the recipe (default: configs/a2d_code_small.py of the package)")
  p.add_argument("--base", default=None, help="the AR checkpoint every variant starts from"
                 " (default: the config's train.init_from)")
  p.add_argument("--steps", type=int, default=200, help="training steps of every variant")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
  p.add_argument("--workdir", default="runs/ablate", help="one run folder a variant (and stage) under it")
  p.add_argument("--eval-batches", type=int, default=8, help="validation batches of the bound")
  p.add_argument("--code-prompts", type=int, default=8, help="held-out code prompts for tokens a pass")
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--new-tokens", type=int, default=64)
  add_output_flags(p, png="", png_help="bars of each variant's bound ratio and tokens a pass")
  a = p.parse_args(argv)
  a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
  unknown = [v for v in a.variants if v not in VARIANTS]
  if not a.variants or unknown:
    p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
  if a.steps < 2 or a.eval_batches < 1 or a.code_prompts < 0 or min(a.prompt_tokens, a.new_tokens) < 1:
    p.error("--steps must be >= 2, --eval-batches >= 1, --code-prompts >= 0, the token counts >= 1")
  return a


def default_config_path() -> str:
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "a2d_code_small.py")


def stage_configs(config, steps: int, stages, workdir: str) -> list[tuple[str, object]]:
  """(workdir, config) of each stage of a variant: its share of `steps`
  (the last takes what is left), its fields set, started from the stage
  before (the first from the config's own init_from)."""
  out, done = [], 0
  for i, (share, fields) in enumerate(stages):
    c = config.copy_and_resolve_references()
    n = steps - done if i == len(stages) - 1 else max(1, round(share * steps))
    done += n
    for key, value in fields.items():
      section, name = key.split(".")
      c[section][name] = value
    # The bench evaluates every variant itself: the run's own closing eval is kept to one batch.
    c.train.update(num_steps=n, eval_every=0, eval_batches=1, checkpoint_every=n, log_every=max(1, n // 10))
    if out:
      c.train.init_from = out[-1][0]
    out.append((workdir if len(stages) == 1 else os.path.join(workdir, f"stage{i + 1}"), c))
  return out


STAGE_RECORD = "ablate_stage.json"  # in a stage's run folder: what training it cost, kept for later tables


def train_variant(config, steps: int, stages, workdir: str) -> dict:
  """Trains each stage not yet finished. `trained_now`: the tokens this call
  trained. The variant's tokens, steady tokens/s and MFU (the trainer's timed
  steps, after the first of each run) and wall hours (compilation and
  checkpoints included) add up what each stage's run recorded when it
  trained, so a later call that only evaluates reports them too (None where
  nothing was timed)."""
  import json
  from mdlm_jax.checkpoints import checkpointer
  from mdlm_jax.training import trainer
  now, total = 0, {"tokens": 0, "wall_s": 0.0, "timed_tokens": 0, "timed_s": 0.0, "flops_s": 0.0}
  stage_runs = stage_configs(config, steps, stages, workdir)
  for path, c in stage_runs:
    done = max(checkpointer.saved_steps(os.path.join(path, "checkpoints")), default=0)
    record_path = os.path.join(path, STAGE_RECORD)
    record = dict.fromkeys(total, 0)
    if os.path.isfile(record_path):
      with open(record_path, encoding="utf-8") as f:
        record.update(json.load(f))
    t0 = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # the runs' progress; stdout keeps the result alone
      out = trainer.train(c, path)
    if out.get("interrupted"):
      raise KeyboardInterrupt(f"{path} stopped at step {out['step']}")
    per_step = c.data.batch_size * c.data.seq_len
    if done < c.train.num_steps:
      trained = (c.train.num_steps - done) * per_step
      now += trained
      record["tokens"] += trained
      record["wall_s"] += time.time() - t0
      tp = out.get("throughput") or {}
      if tp.get("timed_steps"):
        record["timed_tokens"] += tp["timed_steps"] * per_step
        record["timed_s"] += tp["seconds"]
        record["flops_s"] += tp["mfu"] * tp["seconds"]
      tmp = record_path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
      os.replace(tmp, record_path)
    for k in total:
      total[k] += record[k]
  timed = total["timed_s"]
  return {"final": stage_runs[-1][0], "trained_now": now, "trained_tokens": total["tokens"],
          "tokens_per_s": total["timed_tokens"] / timed if timed else None,
          "mfu": total["flops_s"] / timed if timed else None,
          "hours": total["wall_s"] / 3600 if total["tokens"] else None}


def completions(model, prompts, new_tokens: int, scorer) -> dict:
  """Tokens a pass (and gen-PPL, parse rate) at `medium`, and with revision
  where the base is frozen (a full fine-tune's clean stream is not the base:
  there revision would verify against itself)."""
  from mdlm_jax.bench.sample import run_setting
  from mdlm_jax.sampling import presets
  from mdlm_jax.sampling.generate import Generator
  gen = Generator(model)
  settings = {"medium": {"revise": False}}
  if model.config.train.trainable == "adapters":
    # At the presets' draft threshold, and with every draft offered: the second counts the drafts the
    # base would accept however unsure the model is of them, a measure that moves before confidence does.
    settings.update({"revise": {"revise": True}, "revise_all": {"revise": True, "threshold": 0.0}})
  out = {}
  for name, overrides in settings.items():
    sampler = presets.for_model("medium", model.config.diffusion.block_size, in_order=model.spec.cfg.clean_causal,
                                **overrides)
    r = run_setting(gen, prompts, 1, new_tokens, sampler, scorer)
    out[name] = {k: r[k] for k in ("tokens_per_forward", "gen_ppl", "parse_rate") if k in r}
  return out


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from mdlm_jax import cli
  from mdlm_jax.config import load_config_file
  from mdlm_jax.parallel import runtime
  try:
    config = load_config_file(a.config or default_config_path())
  except cli.USER_ERRORS as e:
    cli.fail("bench ablate", e)
  if a.base:
    config.train.init_from = a.base
  if not config.train.init_from:
    cli.fail("bench ablate", ValueError("the config names no train.init_from and --base is not given"))
  runtime.split_cpu_into_devices(config.data.batch_size // config.optim.grad_accum_steps)
  from mdlm_jax import checkpoints
  from mdlm_jax.training.checkpoint_eval import evaluate_checkpoint
  from mdlm_jax.bench.sample import GenPPL, validation_examples
  base_path = config.train.init_from
  base = checkpoints.load(base_path)
  result = {"bench": "ablate", "config": a.config or "configs/a2d_code_small.py", "base": base_path,
            "steps": a.steps, "tokens_per_step": config.data.batch_size * config.data.seq_len, "variants": {}}
  base_eval = evaluate_checkpoint(base_path, num_batches=a.eval_batches, batch_size=config.data.batch_size,
                                  seq_len=config.data.seq_len)
  result["base_ppl"] = base_eval["ppl"]
  scorer = GenPPL(base)
  for name in a.variants:
    what, stages = VARIANTS[name]
    print(f"{name}: {what}", file=sys.stderr, flush=True)
    try:
      row = train_variant(config, a.steps, stages, os.path.join(a.workdir, name))
    except cli.USER_ERRORS as e:
      cli.fail("bench ablate", ValueError(f"variant {name}: {e}"))
    bound = evaluate_checkpoint(row["final"], num_batches=a.eval_batches, batch_size=config.data.batch_size,
                                seq_len=config.data.seq_len)
    row.update({"what": what, "bound_ppl": bound["ppl"], "bound_over_base": bound["ppl"] / base_eval["ppl"]})
    if a.code_prompts:
      model = checkpoints.load(row["final"])
      prompts = [p for p, _ in validation_examples(model, a.code_prompts, a.prompt_tokens, a.new_tokens)]
      row["code"] = completions(model, prompts, a.new_tokens, scorer)
    result["variants"][name] = row
    print(table_row(name, row), file=sys.stderr, flush=True)
  print(table(result), file=sys.stderr)
  finish(result, a, plot)


def table_row(name: str, row: dict) -> str:
  code = row.get("code", {})
  tpp = lambda k: f"{code[k]['tokens_per_forward']:.2f}" if k in code else "-"
  gen = f"{code['medium']['gen_ppl']:.2f}" if "medium" in code and "gen_ppl" in code["medium"] else "-"
  parse = f"{code['medium']['parse_rate']:.2f}" if "medium" in code and "parse_rate" in code["medium"] else "-"
  speed = f"{row['tokens_per_s']:,.0f} ({row['mfu']:.0%})" if row.get("tokens_per_s") else "-"
  return (f"| {name} | {row['bound_ppl']:.2f} | {row['bound_over_base']:.3f} | {tpp('medium')} | {tpp('revise')}"
          f" | {tpp('revise_all')} | {gen} | {parse} | {speed} |")


def table(result: dict) -> str:
  head = ("| variant | bound PPL <= | over the base | tokens a pass (medium) | with revision | every draft offered"
          " | gen-PPL | parses | train tokens/s (MFU) |\n|---|---|---|---|---|---|---|---|---|")
  return "\n".join([f"base: PPL {result['base_ppl']:.2f}, {result['steps']} steps of"
                    f" {result['tokens_per_step']} tokens a variant", head]
                   + [table_row(n, r) for n, r in result["variants"].items()])


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(result["variants"])
  rows = [result["variants"][n] for n in names]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  left.bar(names, [r["bound_over_base"] for r in rows], color="tab:blue")
  left.set_ylabel("bound PPL / base PPL (lower is better)")
  x = range(len(names))
  for k, (setting, label) in enumerate((("medium", "medium"), ("revise", "with revision"),
                                        ("revise_all", "every draft offered"))):
    right.bar([i + 0.27 * (k - 1) for i in x],
              [r.get("code", {}).get(setting, {}).get("tokens_per_forward", 0) for r in rows], width=0.27, label=label)
  right.set_xticks(list(x), names)
  right.set_ylabel("tokens a pass, held-out code")
  right.legend(loc="lower center", fontsize=8)
  for ax in (left, right):
    ax.tick_params(axis="x", rotation=30)
  fig.suptitle(f"A2D choices after {result['steps']} steps of {result['tokens_per_step']} tokens each")
  fig.tight_layout()
  save_figure(fig, path)


if __name__ == "__main__":
  main()
