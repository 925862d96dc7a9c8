"""python -m mdlm_jax.serve [--checkpoint=DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--slots N]
    [--max-context TOKENS | --kv-cache-memory 4GiB] [--prefill-chunk TOKENS]
    [--weight-layout in_out|out_in] [--cors-origins=https://a.example,...] [--log-requests] [--no-warmup]

Serves a diffusion checkpoint (default: the packaged model) behind the OpenAI
API: /v1/models, /v1/chat/completions, /v1/completions, /v1/fim/completions,
plus /health and /metrics. SIGTERM (or Ctrl-C) stops admitting requests, lets
running ones finish within --shutdown-timeout seconds, and exits 0.

A model too large for one host runs as one process per host (the same command
on each, connected like training: --coordinator-address/--num-processes/
--process-id, or auto-detected) with --mesh spanning every device; process 0
serves HTTP and the others decode in lockstep with it until it stops.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading


def parse(argv):
  from mdlm_jax.engine.engine import PASSES_PER_TURN
  from mdlm_jax.model.layers import WEIGHT_LAYOUTS
  from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
  from mdlm_jax.sampling.grammar import ACCEPT_POLICIES
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.serve", description=__doc__.split("\n\n")[1])
  p.add_argument("--checkpoint", help="training workdir, checkpoint or params-only folder (default: packaged)")
  p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set MDLM_API_KEY)")
  p.add_argument("--slots", type=int, default=None,
                 help="requests decoded together in each forward pass (default 8, or as many as --kv-cache-memory"
                      " holds)")
  p.add_argument("--max-context", type=int, default=None,
                 help="KV-cache tokens per request: prompt (and suffix) plus max_tokens rounded up to blocks;"
                      " longer requests get 400 context_length_exceeded (default: --max-prompt-tokens +"
                      " --max-tokens)")
  p.add_argument("--kv-cache-memory", default=None,
                 help="size the slots to this much KV cache (e.g. 4GiB): as many slots of --max-context tokens"
                      " as fit")
  p.add_argument("--mesh", default=None,
                 help="device mesh, e.g. 'data=2,tensor=2' (slots over data, params over fsdp/tensor)")
  p.add_argument("--model-id", default=None, help="the model name clients send (default: the folder name)")
  p.add_argument("--max-prompt-tokens", type=int, default=512)
  p.add_argument("--prefill-chunk", type=int, default=512,
                 help="encode longer prompts this many tokens a turn, between the other requests' passes (chunks"
                      " read earlier chunks and themselves: block-causal over chunks); 0: each prompt in one"
                      " prefill")
  p.add_argument("--max-tokens", type=int, default=512, help="the most tokens one request may generate")
  p.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS, default=None,
                 help="serve from the weights in this layout only (default on CPU: out_in for passes over a few"
                      " slots, in_out for larger ones and prefills, each the faster there; as loaded elsewhere)")
  p.add_argument("--decode-dtype", choices=DECODE_DTYPE_CHOICES, default="auto",
                 help="int8: passes over a few slots read weight-only int8 weights (a scale per output row; a"
                      " quarter of the bytes), converted once at start; w8a8: the same weights, token rows"
                      " rounded to 8 bits in groups of 32 columns (faster passes over several rows); float32:"
                      " the weights as trained; auto: w8a8 on one CPU where the int8 kernels build, else"
                      " float32")
  p.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
  p.add_argument("--passes-per-turn", type=int, default=PASSES_PER_TURN,
                 help="revising passes one launch runs while nothing else needs the host (grammar, logprobs,"
                      " streamed drafts, admissions): the host's work is paid once for them; 1: a launch a pass")
  p.add_argument("--grammar-policy", choices=ACCEPT_POLICIES, default=ACCEPT_POLICIES[0],
                 help="structured outputs: of the grammatical prefix of a pass's proposals, commit up to the effort"
                      " rule's last pick (bridge), only its picks leading from the cursor (confident), or all of it"
                      " (valid: more tokens a pass, lower likelihood)")
  p.add_argument("--admit-batch", type=int, default=4,
                 help="the most waiting requests that share one prefill (each size compiles per prompt bucket)")
  p.add_argument("--admit-wait-ms", type=float, default=20.0,
                 help="an idle server holds its first admission up to this long while more requests are still being"
                      " read, so a burst shares one prefill (a lone request never waits; 0: off)")
  p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                 help="compile every pass and prefill program before serving (default); --no-warmup starts in"
                      " seconds and compiles each program on its first use, so early requests wait (development)")
  p.add_argument("--max-n", type=int, default=8)
  p.add_argument("--max-body-bytes", type=int, default=1 << 20)
  p.add_argument("--shutdown-timeout", type=float, default=30.0)
  p.add_argument("--cors-origins", default="",
                 help="comma-separated browser origins allowed to call the API (CORS), or '*'; none by default")
  p.add_argument("--log-requests", action="store_true",
                 help="one line per finished request on stderr: id, endpoint, user, tokens, finish reasons")
  p.add_argument("--coordinator-address", default=None, help="host:port of process 0 (multi-process serving)")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  a = p.parse_args(argv)
  if a.slots is not None and a.kv_cache_memory is not None:
    p.error("give --slots or --kv-cache-memory, not both")
  if a.kv_cache_memory is not None:
    from mdlm_jax.training.memory_plan import parse_bytes
    try:
      a.kv_cache_memory = parse_bytes(a.kv_cache_memory, "--kv-cache-memory")
    except ValueError as e:
      p.error(str(e))
  for name in ("slots", "max_prompt_tokens", "max_tokens", "max_queue", "max_n", "max_body_bytes", "admit_batch",
               "max_context", "passes_per_turn"):
    if getattr(a, name) is not None and getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  from mdlm_jax.engine.scheduling import MIN_PREFILL_CHUNK
  if a.prefill_chunk < 0 or 0 < a.prefill_chunk < MIN_PREFILL_CHUNK:
    p.error(f"--prefill-chunk must be 0 (off) or at least {MIN_PREFILL_CHUNK}, got {a.prefill_chunk}")
  if a.admit_wait_ms < 0:
    p.error(f"--admit-wait-ms must be >= 0, got {a.admit_wait_ms}")
  if not 0 <= a.port <= 65535:
    p.error(f"--port must be in [0, 65535], got {a.port}")
  if a.mesh is not None:
    from mdlm_jax.config import parse_mesh
    try:
      a.mesh = parse_mesh(a.mesh)
    except ValueError as e:
      p.error(f"--{e}")
  return a


def build(a):
  """(engine, app) for parsed flags."""
  import jax
  from mdlm_jax.checkpoints import packaged
  from mdlm_jax.parallel import sharding
  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import api_key_from_env, create_app
  from mdlm_jax.server.protocol import Limits
  mesh = None
  if a.mesh is not None:
    axes = dict(a.mesh)
    n = math.prod(axes.values())
    if n > len(jax.devices()):
      raise ValueError(f"--mesh needs {n} devices; {len(jax.devices())} are visible")
    if jax.process_count() > 1 and n != len(jax.devices()):
      raise ValueError(f"--mesh must span all {len(jax.devices())} devices of the {jax.process_count()} processes,"
                       f" not {n}")
    mesh = sharding.make_mesh(axes, jax.devices()[:n])
  elif jax.process_count() > 1:
    raise ValueError(f"a {jax.process_count()}-process server needs --mesh over its {len(jax.devices())} devices")
  path = a.checkpoint or packaged.path()
  loaded = checkpoints.load(path, mesh=mesh)
  from mdlm_jax.sampling import presets
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  max_tokens = -(-a.max_tokens // bs) * bs
  slots = a.slots or 8
  if a.kv_cache_memory is not None:
    slots = slots_for_memory(loaded.spec.cfg, a.kv_cache_memory, a.max_context or a.max_prompt_tokens + max_tokens,
                             bs, 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"])
  engine = Engine(loaded, num_slots=slots, max_prompt=a.max_prompt_tokens, max_new_tokens=max_tokens,
                  max_queue=a.max_queue, mesh=mesh, weight_layout=a.weight_layout, decode_dtype=a.decode_dtype,
                  grammar_policy=a.grammar_policy,
                  admit_batch=a.admit_batch, max_context=a.max_context, admit_wait_s=a.admit_wait_ms / 1000,
                  prefill_chunk=a.prefill_chunk, passes_per_turn=a.passes_per_turn)
  limits = Limits(max_body_bytes=a.max_body_bytes, max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens,
                  max_n=a.max_n)
  model_id = a.model_id or os.path.basename(os.path.normpath(path))
  origins = [o.strip() for o in a.cors_origins.split(",") if o.strip()]
  return engine, create_app(engine, model_id=model_id, api_key=api_key_from_env(a.api_key), limits=limits,
                            cors_origins=origins)


def slots_for_memory(cfg, budget: int, context: int, block_size: int, multiple: int) -> int:
  """As many slots of `context` tokens (plus the block a pass writes past it)
  as `budget` bytes of KV cache hold, a multiple of the mesh's row shards."""
  from mdlm_jax.model.kv_cache import KVCache
  per_slot = (context + block_size) * KVCache.bytes_per_token(cfg)
  slots = budget // per_slot // multiple * multiple
  if slots < 1:
    raise ValueError(f"--kv-cache-memory={budget} bytes holds no slot: one slot of {context} tokens needs"
                     f" {per_slot * multiple} bytes{f' ({multiple} row shards)' if multiple > 1 else ''}")
  return slots


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  if a.log_requests:
    import logging as std_logging
    handler = std_logging.StreamHandler()
    handler.setFormatter(std_logging.Formatter("%(asctime)s %(message)s"))
    server_log = std_logging.getLogger("mdlm_jax.server")
    server_log.addHandler(handler)
    server_log.setLevel(std_logging.INFO)
    server_log.propagate = False
  from mdlm_jax import cli
  cli.drop_closed_loop_noise()
  try:
    from mdlm_jax.parallel import distributed
    distributed.initialize(a.coordinator_address, a.num_processes, a.process_id)
    engine, app = build(a)
  except cli.USER_ERRORS as e:
    cli.fail("serve", e)
  import jax
  if jax.process_index() > 0:
    follow(engine, a.warmup)
    return
  import uvicorn

  class Server(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests (503) and drain the engine."""

    def handle_exit(self, sig, frame):
      state = app.state.server
      if not state.shutting_down:
        state.shutting_down = True
        threading.Thread(target=engine.close, args=(a.shutdown_timeout,), daemon=True).start()
      super().handle_exit(sig, frame)
      # uvicorn re-raises the signal after a graceful stop, which would end the
      # process as killed by it; a drained shutdown is a clean exit here.
      self._captured_signals.clear()

  if a.warmup:
    engine.warmup()
  engine.start()
  config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                          timeout_graceful_shutdown=a.shutdown_timeout)
  server = Server(config)
  print(f"serving {app.state.server.model_id} on http://{a.host}:{a.port}/v1 ({engine.num_slots} slots of"
        f" {engine.sc.context} tokens, {engine.kv_cache_bytes / 2**20:.1f} MiB of KV cache, {engine.decode_dtype}"
        " decoding weights)", flush=True)
  cfg = engine.loaded.spec.cfg
  if not (cfg.causal or cfg.clean_causal or engine.loaded.config.diffusion.block_size):
    print(f"note: this model was trained on whole sequences; the server decodes it in cached blocks of"
          f" {engine.sc.block_size}, an approximation that ignores the masked blocks to their right"
          " (python -m mdlm_jax.sample decodes it exactly)", flush=True)
  server.run()
  engine.close(deadline_s=0)
  print("shut down", flush=True)


def follow(engine, warmup: bool = True) -> None:
  """A process other than 0: decode in lockstep with process 0 until it stops
  (warmed up as it is). A signal here is left to process 0's shutdown
  (launchers signal every process)."""
  import signal
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  import jax
  if warmup:
    engine.warmup()
  print(f"process {jax.process_index()}: following process 0", flush=True)
  engine.follow()
  print(f"process {jax.process_index()}: shut down", flush=True)


if __name__ == "__main__":
  main()
