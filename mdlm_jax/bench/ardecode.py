"""python -m mdlm_jax.bench ar [--checkpoint=smollm2-135m-instruct] [--batch-sizes 1,8] [--new-tokens 256] [--json]

An imported AR model decoded three ways on this machine, greedy, every row
writing exactly --new-tokens tokens (EOS does not stop it): this package's
KV-cached AR sampler, transformers' `generate()` (the `interop` extra) and
llama.cpp through llama-cpp-python, each on the same GGUF file. Also the
import cost: loading the GGUF (dequantizing every tensor), converting it once
into a params-only folder, and loading that folder. A runtime that is not
installed is reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from mdlm_jax.bench import common

PROMPTS = ["def fibonacci(n):\n", "The history of the printing press", "import numpy as np\n\n\ndef normalize(x",
           "Write a story about a robot.", "class Stack:\n    def __init__(self):", "Dear team,\n",
           "SELECT name, count(*) FROM", "Once upon a time"]


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench ar", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", default="smollm2-135m-instruct",
                 help="a GGUF file or a registry name (fetched on first use); the other runtimes read the same file")
  p.add_argument("--batch-sizes", default="1,8")
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--repeats", type=int, default=2, help="timed runs per setting after a warm-up (best kept)")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for torch and llama.cpp")
  p.add_argument("--decode-dtypes", default="float32,int8",
                 help="weights our AR sampler decodes from: float32 and/or int8 (weight-only, a scale per row)")
  p.add_argument("--skip", default="", help="comma-separated runtimes to leave out: transformers, llama.cpp")
  common.add_output_flags(p)
  a = p.parse_args(argv)
  a.batch_sizes = common.positive_ints(p, "--batch-sizes", a.batch_sizes)
  if a.new_tokens < 1 or a.repeats < 1:
    p.error("--new-tokens and --repeats must be positive")
  a.decode_dtypes = [d for d in a.decode_dtypes.split(",") if d]
  from mdlm_jax.model.transformer import DECODE_DTYPES
  if not a.decode_dtypes or set(a.decode_dtypes) - set(DECODE_DTYPES):
    p.error(f"--decode-dtypes takes {', '.join(DECODE_DTYPES)}, got {a.decode_dtypes}")
  a.skip = {s for s in a.skip.split(",") if s}
  if a.skip - {"transformers", "llama.cpp"}:
    p.error(f"--skip takes transformers and llama.cpp, got {sorted(a.skip)}")
  return a


def _best(fn, repeats: int) -> float:
  fn()  # warm-up: compilation, caches
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def ours(loaded, prompts, new_tokens: int, repeats: int, decode_dtype: str = "float32",
         bandwidth: float = 0.0) -> dict:
  """Our KV-cached AR sampler's best time; at batch 1, given the machine's
  read `bandwidth`, also a step's bytes and its fraction of their bound
  (prefill included in the time: a few tokens against `new_tokens` steps)."""
  import jax
  import numpy as np
  from mdlm_jax.bench import bound
  from mdlm_jax.model.spec import for_decoding
  from mdlm_jax.sampling.ar import ARSampler
  model = for_decoding(loaded, decode_dtype=decode_dtype)
  ids = [loaded.tokenizer.encode(p) for p in prompts]
  width = max(len(i) for i in ids)
  tokens = np.zeros((len(ids), width), np.int32)
  valid = np.zeros((len(ids), width), bool)
  for r, row in enumerate(ids):
    tokens[r, width - len(row):], valid[r, width - len(row):] = row, True
  sampler = ARSampler(new_tokens, temperature=0.0)

  def run():
    out = sampler.generate(model.spec, model.params, tokens, valid, jax.random.key(0), eos_id=-1, pad_id=0)
    jax.block_until_ready(out["tokens"])
  seconds = _best(run, repeats)
  row = {"seconds": seconds}
  if bandwidth and len(prompts) == 1:  # at batch 1 a step reads every weight and the cache once
    row["bound"] = bound.pass_bound(seconds / new_tokens, bound.weight_bytes(model.params, model.spec.cfg),
                                    width + new_tokens / 2, model.spec.cfg, bandwidth)
  return row


def transformers_generate(path: str, prompts, new_tokens: int, repeats: int, threads: int) -> dict:
  try:
    import torch
    import transformers
  except ImportError:
    return {"error": "not installed (pip install 'mdlm_jax[interop]')"}
  torch.set_num_threads(threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                            dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  tok.padding_side = "left"
  tok.pad_token = tok.pad_token or tok.eos_token
  batch = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)

  def run():
    with torch.no_grad():
      model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                     pad_token_id=tok.pad_token_id)
  return {"seconds": _best(run, repeats), "version": transformers.__version__, "torch_threads": threads}


def in_child(fn, *args):
  """fn(*args) in a fresh (spawned) process: its result, or an error naming how the
  process ended. A llama.cpp build can crash on a CPU feature the machine's kernel
  does not enable (a segmentation fault in the first evaluation); that is then this
  runtime's error row, not the end of the benchmark and its other rows."""
  import multiprocessing
  import queue
  ctx = multiprocessing.get_context("spawn")
  out = ctx.Queue()
  proc = ctx.Process(target=_put_result, args=(out, fn, args), daemon=True)
  proc.start()
  while True:
    try:
      result = out.get(timeout=1.0)
      proc.join()
      return result
    except queue.Empty:
      if not proc.is_alive():
        proc.join()
        return {"error": f"crashed: its process ended with exit code {proc.exitcode} before returning"}


def _put_result(out, fn, args) -> None:
  out.put(fn(*args))


def llama_cpp_generate(path: str, prompt: str, new_tokens: int, repeats: int, threads: int) -> dict:
  """llama.cpp's greedy decoding timed (in a process of its own: `in_child`)."""
  return in_child(_llama_cpp_generate, path, prompt, new_tokens, repeats, threads)


def _llama_cpp_generate(path: str, prompt: str, new_tokens: int, repeats: int, threads: int) -> dict:
  try:
    import llama_cpp
  except ImportError:
    return {"error": "not installed (pip install llama-cpp-python, which builds llama.cpp from source)"}
  llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
  ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)

  def run():
    llm.reset()
    llm.eval(ids)
    for _ in range(new_tokens):  # greedy; EOS does not stop it, as in the other two
      tok = int(llm.scores[llm.n_tokens - 1].argmax())
      llm.eval([tok])
  return {"seconds": _best(run, repeats), "version": llama_cpp.__version__, "threads": threads}


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from mdlm_jax import checkpoints, cli
  from mdlm_jax.checkpoints import gguf_file, params_only, registry
  try:
    path = registry.resolve(a.checkpoint)
    if not gguf_file.is_gguf(path):
      raise ValueError(f"--checkpoint {path}: the runtimes compared read a GGUF file; give one")
  except cli.USER_ERRORS as e:
    cli.fail("bench ar", e)
  import jax
  t0 = time.perf_counter()
  config, tok, named, step, template = gguf_file.read(path)
  read_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  loaded = checkpoints.load(path)
  jax.block_until_ready(loaded.params)
  load_gguf_s = time.perf_counter() - t0
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    params_only.save(os.path.join(tmp, "m"), loaded.params, loaded.config, loaded.tokenizer, step=0,
                     dtype="float32", chat_template=loaded.chat_template)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = checkpoints.load(os.path.join(tmp, "m"))
    jax.block_until_ready(again.params)
    load_folder_s = time.perf_counter() - t0
    del again
  result = {"checkpoint": path, "new_tokens": a.new_tokens, "params": sum(int(v.size) for v in named.values()),
            "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(),
            "import": {"read_gguf_s": read_s, "load_gguf_s": load_gguf_s, "write_params_only_s": convert_s,
                       "load_params_only_s": load_folder_s},
            "runs": []}
  del named
  from mdlm_jax.bench import bound
  result["bandwidth_gb_s"] = bound.read_bandwidth() / 1e9
  progress = common.Progress("bench ar", len(a.batch_sizes) * (2 + len(a.decode_dtypes)))
  for b in a.batch_sizes:
    prompts = (PROMPTS * -(-b // len(PROMPTS)))[:b]
    rows = {}
    for dtype in a.decode_dtypes:
      rows[f"mdlm_jax {dtype}"] = ours(loaded, prompts, a.new_tokens, a.repeats, dtype,
                                      result["bandwidth_gb_s"] * 1e9)
      progress.advance()
    rows["transformers"] = ({"error": "skipped (--skip)"} if "transformers" in a.skip else
                            transformers_generate(path, prompts, a.new_tokens, a.repeats, a.threads))
    progress.advance()
    if "llama.cpp" in a.skip:
      rows["llama.cpp"] = {"error": "skipped (--skip)"}
    elif b == 1:
      rows["llama.cpp"] = llama_cpp_generate(path, prompts[0], a.new_tokens, a.repeats, a.threads)
    else:
      rows["llama.cpp"] = {"error": "llama-cpp-python's Llama decodes one sequence per context"}
    progress.advance()
    for name, r in rows.items():
      if "seconds" in r:
        r["tokens_per_s"] = b * a.new_tokens / r["seconds"]
      result["runs"].append({"runtime": name, "batch": b, **r})
  common.emit(result, a)


if __name__ == "__main__":
  main()
