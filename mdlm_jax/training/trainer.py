"""The training loop: one jit-compiled step under a mesh, EMA, accumulation,
progress, metrics, atomic checkpoints and exact resume."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from mdlm_jax import config as config_lib, data
from mdlm_jax.checkpoints import checkpointer, params_only, registry
from mdlm_jax.parallel import distributed, sharding
from mdlm_jax.training import evaluation, flops
from mdlm_jax.diffusion import objectives
from mdlm_jax import checkpoints
from mdlm_jax.checkpoints.loading import LoadedModel
from mdlm_jax.model.spec import ModelSpec, bind, init_params, model_spec, zero_params
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.training.metrics import MetricsLog, format_duration, plot_loss_curve
from mdlm_jax.model import ModelConfig
from mdlm_jax.data import chat_template
from mdlm_jax.data import chat
from mdlm_jax.data.tokenizer import CHAT_AND_FIM_PIECES, Tokenizer, load_bytes as load_tokenizer_bytes, train_tokenizer


def log(msg: str):
  if jax.process_index() == 0:
    print(msg, flush=True)


def make_optimizer(o: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
  warmup = min(o.warmup_steps, max(num_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else o.learning_rate, peak_value=o.learning_rate, warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1), end_value=o.learning_rate * o.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  chain = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  return optax.chain(*chain, adamw), schedule


def ema_decay_at(decay: float, step):
  """Debiased EMA: follows the params closely early, then `decay`."""
  return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


@dataclasses.dataclass(frozen=True)
class StepConfig:
  accum_steps: int
  ema_decay: float
  adapters_only: bool = False  # train.trainable == "adapters": gradients for the adapters alone


TRAINABLE = ("all", "adapters")


def is_adapter(path) -> bool:
  """A low-rank adapter's parameter (model.lora_rank): what `train.trainable="adapters"` trains."""
  return params_only.is_adapter_name(".".join(str(getattr(k, "key", k)) for k in path))


def partition(params, adapters_only: bool):
  """(trained, frozen): two trees of `params`' structure, each None where the other holds the leaf."""
  if not adapters_only:
    return params, jax.tree.map(lambda _: None, params)
  pick = lambda want: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, x: x if is_adapter(path) == want else None, params)
  return pick(True), pick(False)


def combine(trained, frozen):
  return jax.tree.map(lambda a, b: b if a is None else a, trained, frozen, is_leaf=lambda x: x is None)


def make_train_step(spec: ModelSpec, objective, optimizer, sc: StepConfig):
  """Returns step(weights, train, batch, key) -> (weights, train, metrics);
  `batch` is the tokens [b, l], or {"tokens", "loss_mask"} for instruction
  tuning (data/chat.py)."""

  def loss_sum(trained, frozen, batch, key):
    return objective(bind(spec, combine(trained, frozen)), batch["tokens"], key, loss_mask=batch.get("loss_mask"))

  value_and_grad = jax.value_and_grad(loss_sum, has_aux=True)  # only the trained tree: frozen weights get no dW

  def step(weights, train, batch, key):
    params, frozen = partition(weights["params"], sc.adapters_only)
    grad_fn = lambda p, b, k: value_and_grad(p, frozen, b, k)  # noqa: E731
    batch = batch if isinstance(batch, dict) else {"tokens": batch}
    key = jax.random.fold_in(key, train["step"])
    if sc.accum_steps == 1:
      (total, count), grads = grad_fn(params, batch, key)
    else:
      micro = jax.tree.map(lambda x: sharding.constrain(x.reshape(sc.accum_steps, -1, x.shape[-1]),
                                                        (None, "batch", "length")), batch)

      def body(carry, xs):
        i, mb = xs
        g_acc, s_acc, n_acc = carry
        (s, n), g = grad_fn(params, mb, jax.random.fold_in(key, i))
        return (jax.tree.map(jnp.add, g_acc, g), s_acc + s, n_acc + n), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      (grads, total, count), _ = jax.lax.scan(
          body, (zeros, jnp.zeros(()), jnp.zeros(())), (jnp.arange(sc.accum_steps), micro))
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = optimizer.update(grads, train["opt_state"], params)
    params = combine(optax.apply_updates(params, updates), frozen)
    new_weights = {"params": params}
    if "ema" in weights:
      d = ema_decay_at(sc.ema_decay, train["step"].astype(jnp.float32))
      # Frozen weights are their own average: carried over exactly, not rounded by d * p + (1 - d) * p.
      trained_now, frozen_now = partition(params, sc.adapters_only)
      ema = jax.tree.map(lambda e, p: d * e + (1 - d) * p, partition(weights["ema"], sc.adapters_only)[0],
                         trained_now)
      new_weights["ema"] = combine(ema, frozen_now)
    metrics = {"loss": total / count, "grad_norm": optax.global_norm(grads)}
    return new_weights, {"step": train["step"] + 1, "opt_state": opt_state}, metrics

  return step


class Stop:
  """Turns SIGINT/SIGTERM into a flag the loop checks between steps, so the
  checkpoint written on the way out is always of a completed step."""

  def __init__(self):
    self.requested = False
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.requested:  # a second Ctrl-C exits at once
      raise KeyboardInterrupt
    self.requested = True
    log(f"\nsignal {signum}: finishing the current step, saving a checkpoint, then exiting")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def setup_tokenizer(config, workdir: str, train_docs, resumed_meta: dict | None,
                    init: LoadedModel | None = None) -> Tokenizer | HFTokenizer:
  """The checkpoint's tokenizer on resume, else the configured file, else the
  `train.init_from` model's, else one trained on the training split. Trained
  once, on process 0, and broadcast."""
  if resumed_meta is not None:
    return load_tokenizer_bytes(checkpointer.meta_tokenizer_bytes(resumed_meta))
  if init is not None:
    if config.data.tokenizer and Tokenizer.from_file(config.data.tokenizer).to_bytes() != init.tokenizer.to_bytes():
      raise config_lib.ConfigError(f"config.data.tokenizer={config.data.tokenizer} differs from the tokenizer of"
                                   f" config.train.init_from={config.train.init_from}; leave data.tokenizer empty")
    return init.tokenizer
  if config.data.tokenizer:
    if not os.path.isfile(config.data.tokenizer):
      raise FileNotFoundError(f"config.data.tokenizer: no such file {config.data.tokenizer}")
    return Tokenizer.from_file(config.data.tokenizer)
  path = os.path.join(workdir, "tokenizer.model")
  proto = None
  if jax.process_index() == 0:
    if os.path.isfile(path):
      proto = Tokenizer.from_file(path).to_bytes()
    else:
      log(f"training a {config.data.tokenizer_vocab_size}-piece sentencepiece tokenizer -> {path}")
      t0 = time.time()
      # A model that learns fill-in-the-middle needs its markers as pieces.
      pieces = CHAT_AND_FIM_PIECES if float(config.data.fim_rate) > 0 else ()
      proto = train_tokenizer(train_docs, path, config.data.tokenizer_vocab_size,
                              config.data.tokenizer_max_chars, pieces).to_bytes()
      log(f"tokenizer trained in {time.time() - t0:.1f}s")
  return Tokenizer.from_bytes(distributed.broadcast_bytes(proto))


def load_init(config, mesh) -> LoadedModel | None:
  """The `train.init_from` model (EMA weights when it has them), or None."""
  path = config.train.init_from
  if not path:
    return None
  if not os.path.exists(path) and path not in registry.MODELS:
    raise FileNotFoundError(f"config.train.init_from: no such checkpoint {path}")
  return checkpoints.load(path, mesh)


def init_from_weights(init: LoadedModel, spec: ModelSpec, path: str, fresh=None):
  """`init`'s parameters laid out as `spec`'s; the shapes must match exactly
  (the causal flag and objective may differ: that is the point). Adapters
  (model.lora_rank) the init model lacks take their values from
  `fresh(names)`, the new model's initialisation of just those parameters
  ({name: array}; their up-projections start at zero, so the adapted model
  starts as `init`)."""
  have = jax.tree_util.tree_flatten_with_path(init.params)[0]
  want = jax.tree_util.tree_flatten_with_path(spec.abstract)[0]
  have_shapes = {jax.tree_util.keystr(k): v.shape for k, v in have}
  added = [k for k, _ in want if jax.tree_util.keystr(k) not in have_shapes and is_adapter(k)]
  if added and fresh is not None:
    have_by_name = {jax.tree_util.keystr(k): v for k, v in have}
    fresh_by_name = fresh(frozenset(jax.tree_util.keystr(k) for k in added))
    names = [jax.tree_util.keystr(k) for k, _ in want]
    leaves = [have_by_name[n] if n in have_by_name else fresh_by_name[n] for n in names]
    full = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(spec.abstract), leaves)
    return init_from_weights(dataclasses.replace(init, params=full), spec, path)
  for k, v in want:
    name = jax.tree_util.keystr(k)
    if name not in have_shapes:
      raise config_lib.ConfigError(f"config.train.init_from={path} has no parameter {name}")
    if tuple(have_shapes[name]) != tuple(v.shape):
      raise config_lib.ConfigError(f"config.train.init_from={path}: parameter {name} has shape"
                                   f" {tuple(have_shapes[name])}, this model needs {tuple(v.shape)}")
  if len(have) != len(want):
    raise config_lib.ConfigError(f"config.train.init_from={path} has {len(have)} parameters, this model {len(want)}")
  return jax.tree.map(lambda a, s, sh: jax.device_put(a.astype(s.dtype), sh), init.params, spec.abstract,
                      spec.shardings)


def num_reader_shards(config) -> int:
  return config.data.num_shards or jax.process_count()


def check_batch_layout(config, mesh) -> None:
  b, accum = config.data.batch_size, config.optim.grad_accum_steps
  shards, procs = num_reader_shards(config), jax.process_count()
  if shards % procs:
    raise config_lib.ConfigError(f"config.data.num_shards={shards} is not divisible by {procs} processes")
  if b % shards:
    raise config_lib.ConfigError(f"config.data.batch_size={b} is not divisible by data.num_shards={shards}")
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if b % accum:
    raise config_lib.ConfigError(f"config.data.batch_size={b} is not divisible by optim.grad_accum_steps={accum}")
  if (b // accum) % shards:
    raise config_lib.ConfigError(
        f"config.data.batch_size={b} / grad_accum_steps={accum} is not divisible by the"
        f" {shards} batch shards of the mesh (data x fsdp)")
  if b % jax.process_count():
    raise config_lib.ConfigError(f"config.data.batch_size={b} is not divisible by {jax.process_count()} processes")


def check_same_model(saved: dict, current: ml_collections.ConfigDict) -> None:
  cur = json.loads(current.to_json_best_effort())
  # A field the checkpoint lacks was added after it was written: it trained with the default.
  defaults = json.loads(config_lib.base_config().model.to_json_best_effort())
  for k, v in cur["model"].items():
    was = saved["model"].get(k, defaults.get(k))
    if was != v:
      raise checkpointer.CheckpointError(
          f"the workdir's checkpoint has model.{k}={was!r} but the config says {v!r};"
          " use a new --workdir or the same model config")
  saved_block = saved.get("diffusion", {}).get("block_size", 0)
  if saved_block != cur["diffusion"].get("block_size", 0):
    raise checkpointer.CheckpointError(
        f"the workdir's checkpoint has diffusion.block_size={saved_block} but the config says"
        f" {cur['diffusion'].get('block_size', 0)}; use a new --workdir")
  if saved.get("objective") != cur["objective"]:
    raise checkpointer.CheckpointError(f"the workdir's checkpoint was trained with objective"
                                     f" {saved.get('objective')!r}, the config says {cur['objective']!r}")


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) in `workdir`; returns the final metrics."""
  config_lib.validate(config)
  distributed.check_same("config", config.to_json_best_effort(sort_keys=True))
  with sharding.axis_rules(sharding.rules_of(config)):
    return _train(config, workdir)


def _train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  is_main = jax.process_index() == 0
  mesh = sharding.make_mesh(config.mesh)
  check_batch_layout(config, mesh)
  ckpt = checkpointer.Checkpointer(workdir, every=config.train.checkpoint_every,
                                 keep=config.train.keep_checkpoints)
  resumed_meta = None
  if ckpt.latest_step() is not None:
    resumed_meta = checkpointer.read_meta(workdir)[0]
    check_same_model(resumed_meta["config"], config)

  chat_run = config.data.kind == "chat"
  if chat_run:  # instruction tuning: conversations, rendered with the run's chat template
    template = chat_template.named(config.data.chat_template)
    conversations = chat.read_jsonl(os.path.join(config.data.corpus, "train.jsonl"))
    train_docs = [chat.text_of(c, template) for c in conversations]
  else:
    train_docs = data.load_documents(config.data.corpus, "train", config.data.validation_fraction,
                                     config.data.text_field)
  init = load_init(config, mesh) if resumed_meta is None else None
  tokenizer = setup_tokenizer(config, workdir, train_docs, resumed_meta, init)
  cfg = ModelConfig.from_config(config.model, vocab_size=tokenizer.vocab_size)
  if config.model.vocab_size not in (-1, tokenizer.vocab_size):
    raise config_lib.ConfigError(f"config.model.vocab_size={config.model.vocab_size} but the tokenizer has"
                                 f" {tokenizer.vocab_size} pieces; use -1 to take the tokenizer's")
  spec = model_spec(cfg, mesh)
  objective = objectives.from_config(config, tokenizer.mask_id, training=True)
  eval_objective = objectives.from_config(config, tokenizer.mask_id)
  optimizer, lr_schedule = make_optimizer(config.optim, config.train.num_steps)
  use_ema = config.optim.ema_decay > 0
  meta = checkpointer.make_meta(config, tokenizer.to_bytes(), {"has_ema": use_ema, "objective": config.objective})

  local_batch = config.data.batch_size // jax.process_count()
  fim_rate = float(config.data.fim_rate)
  if chat_run:
    rows = chat.rows(conversations, tokenizer, template, config.data.seq_len)
    infills = int(rows.is_infill.sum())
    log(f"{len(rows.tokens) - infills} conversations and {infills} infill records,"
        f" {rows.too_long} longer than {config.data.seq_len} tokens left out; data.fim_rate={fim_rate} of the"
        " rows are infills")
    buckets = config_lib.parse_buckets(config.data.length_buckets)
    if buckets:
      cut = chat.bucket_of(rows.used, buckets, config.data.seq_len)
      log("rows by length bucket: " + ", ".join(f"<= {b}: {int((cut == b).sum())}"
                                                for b in sorted({*buckets, config.data.seq_len})))
    it = chat.train_iterator(rows, local_batch, config.data.shuffle_seed, infill_rate=fim_rate, buckets=buckets,
                             process_index=jax.process_index(), process_count=jax.process_count())
  else:
    it = data.make_train_iterator(train_docs, tokenizer, seq_len=config.data.seq_len, batch_size=local_batch,
                                  seed=config.data.shuffle_seed, process_index=jax.process_index(),
                                  process_count=jax.process_count(), num_shards=num_reader_shards(config),
                                  fim_rate=fim_rate,
                                  fim_spm_rate=float(config.data.fim_spm_rate),
                                  fim_level=config.data.fim_level)
  with jax.set_mesh(mesh):
    if resumed_meta is not None:  # the checkpoint's values replace these
      params = zero_params(spec)
    elif init is None:
      params = init_params(spec, config.seed)
    else:  # only what the init model lacks (adapters) is initialised
      params = init_from_weights(init, spec, config.train.init_from,
                                 fresh=lambda names: init_params(spec, config.seed, only=names))
      log(f"initialised from {config.train.init_from} (step {init.step})")
      del init
    weights = {"params": params}
    if use_ema:
      weights["ema"] = jax.tree.map(jnp.copy, params)
    opt_state = jax.jit(optimizer.init)(partition(params, config.train.trainable == "adapters")[0])
    train_state = {"step": jnp.zeros((), jnp.int32), "opt_state": opt_state}
    if resumed_meta is not None:
      w_abs = checkpointer.abstract_like(weights)
      t_abs = checkpointer.abstract_like(train_state)
      del weights, train_state, params, opt_state
      weights, train_state, _ = ckpt.restore(w_abs, t_abs, it)
    step = int(train_state["step"])
    if resumed_meta is not None:
      log(f"resumed from {workdir} at step {step}")

    out_shardings = (jax.tree.map(lambda x: x.sharding, weights), jax.tree.map(lambda x: x.sharding, train_state),
                     None)
    step_fn = jax.jit(make_train_step(spec, objective, optimizer,
                                      StepConfig(config.optim.grad_accum_steps, config.optim.ema_decay,
                                                 adapters_only=config.train.trainable == "adapters")),
                      out_shardings=out_shardings, donate_argnums=(0, 1))
    batch_sharding = sharding.batch_sharding(mesh)
    base_key = jax.random.PRNGKey(config.seed)

    n_params = sum(x.size for x in jax.tree.leaves(params if resumed_meta is None else weights["params"]))
    tokens_per_step = config.data.batch_size * config.data.seq_len

    @functools.cache
    def step_cost(length: int) -> tuple[int, float]:
      """(tokens, FLOPs) of a step over rows of `length` (chat buckets make rows shorter)."""
      tokens = config.data.batch_size * length
      if config.diffusion.block_size and config.objective == "mdlm":
        views = 2 if config.diffusion.complementary_masks else 1  # each row run once per view
        if cfg.clean_causal and config.train.trainable == "adapters":
          return tokens, views * flops.adapter_train_flops_per_token(cfg, length) * tokens
        return tokens, views * flops.block_diffusion_train_flops_per_token(cfg, length) * tokens
      return tokens, flops.train_flops_per_token(cfg, length) * tokens

    flops_per_step = step_cost(config.data.seq_len)[1]
    peak = config.train.peak_flops_per_device or flops.device_peak_flops()
    peak_total = peak * jax.device_count()
    log(f"model: {n_params / 1e6:.2f}M params, objective {config.objective}, vocab {cfg.vocab_size},"
        f" mesh {dict(mesh.shape)}, {tokens_per_step} tokens/step, peak {peak_total / 1e9:.0f} GFLOP/s")

    metrics_log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), enabled=is_main)
    png = os.path.join(workdir, "loss.png")
    eval_docs = None
    eval_batches = None

    def run_eval(step: int) -> dict:
      nonlocal eval_docs, eval_batches
      if eval_batches is None and chat_run:
        held_out = chat.load(config.data.corpus, "validation", tokenizer, template, config.data.seq_len)
        eval_batches = chat.eval_batches(chat.select(held_out, fim_rate), config.data.batch_size,
                                         config.train.eval_batches)
      elif eval_batches is None:
        eval_docs = data.load_documents(config.data.corpus, "validation", config.data.validation_fraction,
                                        config.data.text_field)
        eval_batches = data.make_eval_batches(eval_docs, tokenizer, seq_len=config.data.seq_len,
                                              batch_size=config.data.batch_size,
                                              num_batches=config.train.eval_batches)
      p = weights["ema"] if use_ema else weights["params"]
      res = evaluation.evaluate(spec, eval_objective, p, eval_batches, time_samples=config.eval.time_samples,
                                seed=config.eval.seed, mesh=mesh)
      log(f"eval step {step}: {evaluation.describe(res)}")
      metrics_log.write({"kind": "eval", "step": step, **res})
      return res

    def save(step: int):
      ckpt.save(step, weights, train_state, it, meta)

    last = {}
    t_last, step_last = time.perf_counter(), step
    t_start, step_start = t_last, step
    compiled_at = None
    window = [0, 0.0]  # tokens and FLOPs since the last log line
    timed = [0, 0.0]  # ... and since the first (compiled) step

    def stop_agreed(stop: Stop) -> bool:
      # Every process must leave the loop at the same step (the save and the
      # step are collectives); they agree at log steps, where the host waits anyway.
      if jax.process_count() == 1:
        return stop.requested
      return step % config.train.log_every == 0 and distributed.any_process(stop.requested)

    stopping = False
    with Stop() as stop:
      while step < config.train.num_steps and not stopping:
        batch = {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
                 for k, v in next(it).items()}
        weights, train_state, m = step_fn(weights, train_state, batch, base_key)
        step += 1
        cost = step_cost(batch["tokens"].shape[1])
        window, timed = [window[0] + cost[0], window[1] + cost[1]], [timed[0] + cost[0], timed[1] + cost[1]]
        if compiled_at is None:
          jax.block_until_ready(m)
          compiled_at = step
          t_last, step_last = time.perf_counter(), step
          t_start, step_start = t_last, step
          window, timed = [0, 0.0], [0, 0.0]
          log(f"step {step}: compiled and ran the first step")
        if step % config.train.log_every == 0 or step == config.train.num_steps:
          m = jax.device_get(m)
          now = time.perf_counter()
          n = step - step_last
          dt = max(now - t_last, 1e-9)
          tps = window[0] / dt if n else float("nan")
          mfu = window[1] / dt / peak_total if n else float("nan")
          window = [0, 0.0]
          rate = (step - step_start) / max(now - t_start, 1e-9)
          eta = (config.train.num_steps - step) / rate if rate > 0 else float("nan")
          loss = float(m["loss"])
          last = {"kind": "train", "step": step, "loss": loss, "bits_per_token": loss / math.log(2),
                  "grad_norm": float(m["grad_norm"]), "lr": float(lr_schedule(step - 1)),
                  "tokens_per_s": tps, "mfu": mfu}
          metrics_log.write(last)
          log(f"step {step:>6}/{config.train.num_steps}  loss {loss:.4f}  {last['bits_per_token']:.3f} bits/tok"
              f"  |g| {last['grad_norm']:.2f}  lr {last['lr']:.2e}  {tps:,.0f} tok/s  MFU {100 * mfu:.1f}%"
              f"  ETA {format_duration(eta) if eta == eta else '?'}")
          if is_main:
            plot_loss_curve(metrics_log.read(), png, title=f"{config.objective} training")
          t_last, step_last = now, step
        if ckpt.should_save(step):
          save(step)
        if config.train.eval_every and step % config.train.eval_every == 0 and step < config.train.num_steps:
          run_eval(step)  # the last step is evaluated once, below
        stopping = stop_agreed(stop)
      t_end = time.perf_counter()
      save(step)
      if stopping:
        log(f"saved checkpoint at step {step} in {workdir}; run the same command to resume")
        ckpt.close()
        return {"interrupted": True, "step": step, **last}
    timed_steps, timed_s = step - step_start, t_end - t_start
    throughput = {
        "timed_steps": timed_steps, "seconds": timed_s,
        "tokens_per_s": timed[0] / timed_s if timed_steps else float("nan"),
        "mfu": timed[1] / timed_s / peak_total if timed_steps else float("nan"),
        "peak_flops": peak_total, "train_flops_per_token": flops_per_step / tokens_per_step,
        "params": int(n_params),
    }
    final = run_eval(step)
    if is_main:
      plot_loss_curve(metrics_log.read(), png, title=f"{config.objective} training")
    ckpt.close()
    return {"step": step, "train": last, "eval": final, "throughput": throughput}
