"""python -m mdlm_jax.sample [--checkpoint=DIR] --prompt=TEXT [--suffix=TEXT] [options]

Generates with a trained MDLM: the prompt stays fixed, the generation region
starts as [MASK] and is refined in parallel; with --suffix the region is the
middle between prompt and suffix (infilling). --show-steps redraws the draft
after every refinement step.
"""

from __future__ import annotations

import argparse
import re
import json
import sys

from mdlm_jax import cli


def _widths(text: str) -> tuple[int, ...]:
  """--pass-widths: comma-separated integers ('' for none)."""
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse(argv):
  from mdlm_jax.sampling.presets import DEFAULT_EFFORT, EFFORTS
  from mdlm_jax.sampling.samplers import SAMPLERS
  from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.sample", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", help="training workdir or checkpoint folder (default: the packaged model)")
  p.add_argument("--prompt", required=True, help="text to continue (with --chat: the user's message)")
  p.add_argument("--chat", action="store_true",
                 help="send --prompt as a user message through the checkpoint's chat template and print the answer")
  p.add_argument("--system", default=None, help="with --chat: a system message before the user's")
  p.add_argument("--suffix", default=None, help="text after the generated middle (fill-in-the-middle)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--infill-lengths", default=None,
                 help="with --suffix: try these middle lengths (e.g. 8,16,32) and keep the most likely")
  p.add_argument("--effort", default=DEFAULT_EFFORT, choices=EFFORTS, help="speed/quality preset")
  p.add_argument("--sampler", choices=sorted(SAMPLERS), default=None,
                 help="use this sampler instead of the preset's")
  p.add_argument("--steps", type=int, default=None, help="refinement steps (per block)")
  p.add_argument("--block-size", type=int, default=None, help="semi-autoregressive block size (0: one block)")
  p.add_argument("--threshold", type=float, default=None, help="confidence threshold (threshold sampler)")
  p.add_argument("--min-tokens", type=int, default=None,
                 help="tokens committed per pass at least (threshold sampler)")
  p.add_argument("--revise", action=argparse.BooleanOptionalAction, default=None,
                 help="an AR model adapted to diffusion: keep drafts only where the base's own causal pass agrees"
                      " (the base's text, drafted ahead; --threshold picks the drafts offered). Default: as the"
                      " effort has it (medium and high revise a prompt's answer)")
  p.add_argument("--agreement", type=float, default=None,
                 help="with revision: also keep a draft the base finds at least this share as likely as its best"
                      " token (in (0, 1]; 1: the base's text exactly; lower: more tokens a pass, text near the"
                      " base's)")
  p.add_argument("--lookup", type=int, default=None,
                 help="with revision: also offer drafts copied from the prompt and the text so far where its last"
                      " LOOKUP tokens occurred before (0 to 4; 0: the model's drafts only). Default: as the effort"
                      " has it (2 at medium and high)")
  p.add_argument("--head-width", type=int, default=None,
                 help="with revision: the columns of the verified head (at least the block size; 0: the block"
                      " size; default: as the effort has it, 6 on CPU with copied drafts). Copied and table drafts"
                      " run past the model's block, so a wider head keeps more tokens a pass (the packaged"
                      " default's HumanEval chat answers: 2.37 a pass at 4, 2.72 at 6); the text stays the base's")
  p.add_argument("--model-drafts", action=argparse.BooleanOptionalAction, default=None,
                 help="with revision: whether each pass also runs the model's masked block, whose proposals are"
                      " drafts (--no-model-drafts: copies and the draft table draft, and a pass carries the head's"
                      " rows alone). Default: off on CPU, where a pass costs about its rows, on elsewhere; the text"
                      " stays the base's either way")
  p.add_argument("--table-floor", type=float, default=None,
                 help="with revision and lookup: the draft table's chain of drafts stops where its chance of"
                      " holding (the product of its steps' shares in the answers the table was built from) falls"
                      " below this (in [0, 1]; default 0: the chain runs to the head's end). Worth it only with"
                      " --pass-widths")
  p.add_argument("--pass-widths", type=_widths, default=None,
                 help="with --no-model-drafts: comma-separated increasing widths a pass of the head may take, the"
                      " last the head's; each pass takes the narrowest that holds its drafts (default '': always"
                      " the head's). On this CPU a narrowed pass saved a sixth at one column, little above it")
  p.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=None,
                 help="cached blocks (default for BD3-LM models, exact for them) or full-canvas passes (default for"
                      " models trained on whole sequences, exact for them; cached blocks ignore the masked blocks"
                      " to their right)")
  p.add_argument("--temperature", type=float, default=None)
  p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens with this mass")
  p.add_argument("--presence-penalty", type=float, default=None,
                 help="subtracted from the logit of every token already generated (OpenAI's, in [-2, 2])")
  p.add_argument("--frequency-penalty", type=float, default=None,
                 help="subtracted from a token's logit once per time it was generated (OpenAI's, in [-2, 2])")
  p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                 help="add BIAS (in [-100, 100]) to token ID's logit (repeatable; -100 bans it)")
  p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
  p.add_argument("--decode-dtype", choices=DECODE_DTYPE_CHOICES, default="auto",
                 help="int8: decode from weight-only int8 weights (a scale per output row; a quarter of the bytes"
                      " a pass reads), converted once at load; w8a8: the same weights, token rows rounded to"
                      " 8 bits in groups of 32 columns (faster passes over several rows); float32: the weights as"
                      " trained; auto: w8a8 on one CPU where the int8 kernels build, else float32")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--num-samples", type=int, default=1)
  p.add_argument("--no-bos", action="store_true", help="do not start the prompt with BOS")
  p.add_argument("--show-steps", action="store_true", help="redraw the draft after every refinement step")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  a = p.parse_args(argv)
  if a.max_new_tokens < 1:
    p.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
  if a.num_samples < 1:
    p.error(f"--num-samples must be >= 1, got {a.num_samples}")
  if a.infill_lengths is not None:
    if a.suffix is None:
      p.error("--infill-lengths needs --suffix")
    try:
      a.infill_lengths = [int(x) for x in a.infill_lengths.split(",")]
    except ValueError:
      p.error(f"--infill-lengths must be comma-separated integers, got {a.infill_lengths!r}")
    if min(a.infill_lengths) < 1:
      p.error("--infill-lengths must be positive")
  if a.system is not None and not a.chat:
    p.error("--system needs --chat")
  if a.chat and (a.suffix is not None or a.no_bos):
    p.error("--chat renders the whole prompt: --suffix and --no-bos do not apply")
  if len(a.stop) > 4:
    p.error("at most 4 --stop strings")
  bias = []
  for item in a.logit_bias:
    tok, eq, value = item.partition("=")
    try:
      if not eq:
        raise ValueError
      bias.append((int(tok), float(value)))
    except ValueError:
      p.error(f"--logit-bias takes ID=BIAS (a token id and a number), got {item!r}")
  a.logit_bias = tuple(bias)
  return a


class DraftView:
  """Redraws the current draft in place on a terminal, or appends it otherwise."""

  def __init__(self, prompt: str, stream=sys.stderr):
    self.prompt, self.stream = prompt, stream
    self.tty = stream.isatty()

  def __call__(self, step: int, drafts: list[str]):
    body = "\n---\n".join(self.prompt + d for d in drafts)
    if self.tty:
      self.stream.write("\x1b[2J\x1b[H" + f"[step {step}]\n" + body + "\n")
    else:
      self.stream.write(f"[step {step}]\n{body}\n")
    self.stream.flush()


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  cli.drop_closed_loop_noise()
  try:
    from mdlm_jax.checkpoints import packaged
    from mdlm_jax import checkpoints
    from mdlm_jax.sampling.ar import ARSampler
    from mdlm_jax.sampling.generate import generator_for
    from mdlm_jax.sampling import presets
    loaded = checkpoints.load(a.checkpoint or packaged.path())
    gen = generator_for(loaded, decode_dtype=a.decode_dtype)
    if loaded.spec.cfg.causal:
      diffusion_only = (a.sampler, a.steps, a.block_size, a.threshold, a.min_tokens, a.infill_lengths, a.revise,
                        a.agreement, a.lookup, a.head_width, a.model_drafts, a.table_floor, a.pass_widths)
      if a.show_steps or a.kv_cache is not None or any(v is not None for v in diffusion_only):
        raise ValueError("this checkpoint is autoregressive: --show-steps, --infill-lengths, --sampler, --steps,"
                         " --block-size, --threshold, --min-tokens, --revise, --agreement, --lookup, --head-width,"
                         " --[no-]model-drafts, --table-floor, --pass-widths and"
                         " --[no-]kv-cache apply to diffusion models only")
      sampler = ARSampler(a.max_new_tokens, temperature=a.temperature or 0.0,
                          top_p=1.0 if a.top_p is None else a.top_p, presence_penalty=a.presence_penalty or 0.0,
                          frequency_penalty=a.frequency_penalty or 0.0, logit_bias=a.logit_bias)
    else:
      try:
        sampler = presets.for_model(a.effort, loaded.config.diffusion.block_size, sampler=a.sampler,
                                    in_order=loaded.spec.cfg.clean_causal, revisable=a.suffix is None,
                                    steps=a.steps, block_size=a.block_size, threshold=a.threshold,
                                    temperature=a.temperature, top_p=a.top_p, min_tokens=a.min_tokens,
                                    kv_cache=a.kv_cache, revise=a.revise, agreement=a.agreement,
                                    lookup=a.lookup, head_width=a.head_width, model_drafts=a.model_drafts,
                                    table_floor=a.table_floor, pass_widths=a.pass_widths,
                                    presence_penalty=a.presence_penalty,
                                    frequency_penalty=a.frequency_penalty, logit_bias=a.logit_bias or None)
      except ValueError as e:  # the sampler names its field; the user typed the flag
        raise ValueError(re.sub(r"^(\w+) must", lambda m: f"--{m.group(1).replace('_', '-')} must", str(e))) from e
    text, add_bos, stops = a.prompt, not a.no_bos, list(a.stop)
    if a.chat:
      from mdlm_jax.server import chat_template
      messages = ([{"role": "system", "content": a.system}] if a.system is not None else []) + [
          {"role": "user", "content": a.prompt}]
      text, turn_ends, add_bos = chat_template.render(messages, loaded.chat_template, loaded.tokenizer)
      stops += [s for s in turn_ends if s not in stops]
    prompts = [text] * a.num_samples
    suffixes = [a.suffix] * a.num_samples if a.suffix is not None else None
    view = DraftView(text) if a.show_steps else None
    if a.infill_lengths:
      best, scores = gen.infill(a.prompt, a.suffix, sampler=sampler, lengths=a.infill_lengths, seed=a.seed)
      print(f"[infill NELBO nats/token by middle length: "
            f"{', '.join(f'{n}: {v:.3f}' for n, v in scores.items())}]", file=sys.stderr)
      a.max_new_tokens = min(scores, key=scores.get)
      suffixes = [a.suffix] * a.num_samples
    result = gen.generate(prompts, max_new_tokens=a.max_new_tokens, sampler=sampler, seed=a.seed,
                          suffixes=suffixes, stop=stops, add_bos=add_bos, on_draft=view)
  except cli.USER_ERRORS as e:
    cli.fail("sample", e)
  new_tokens = sum(len(c.tokens) for c in result.completions)
  stats = {"forward_passes": result.forward_passes, "steps": result.steps, "seconds": result.seconds,
           "new_tokens": new_tokens,
           "tokens_per_forward": new_tokens / max(result.forward_passes, 1) / len(result.completions),
           "tokens_per_s": new_tokens / max(result.seconds, 1e-9), "sampler": repr(sampler),
           "decode_dtype": gen.decode_dtype}
  if a.json:
    print(json.dumps({"completions": [{"text": c.text, "finish_reason": c.finish_reason,
                                       "tokens": len(c.tokens)} for c in result.completions], **stats}))
    return
  for i, c in enumerate(result.completions):
    if len(result.completions) > 1:
      print(f"=== sample {i} ({c.finish_reason}) ===")
    print(c.text if a.chat else a.prompt + c.text + (a.suffix or ""))
  print(f"[{new_tokens} tokens in {result.forward_passes} forward passes, {stats['seconds']:.2f}s"
        f" incl. compile; {gen.decode_dtype} weights; {repr(sampler)}]", file=sys.stderr)


if __name__ == "__main__":
  main()
