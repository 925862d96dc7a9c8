"""The one config schema every experiment file starts from, and its validation.

Config files in configs/ call `base_config()` and override fields; the CLI may
override any field with `--config.section.field=value`. `validate` runs once,
before anything touches a device, so a typo fails in a second with a message
naming the field instead of minutes later inside jit.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from mdlm_jax import kernels
from mdlm_jax.model.rope import RopeScaling
from mdlm_jax.parallel import sharding

SCHEDULES = ("loglinear", "linear", "cosine")
OBJECTIVES = ("mdlm", "ar")
MLPS = ("swiglu", "gelu")
DTYPES = ("float32", "bfloat16", "float16")
# "pallas": fused kernels on GPU/TPU, the XLA reference elsewhere; "pallas_interpret":
# the kernels under the Pallas interpreter on any backend (tests only: slow).
ATTENTION = kernels.ATTENTION_IMPLEMENTATIONS
SHARDING_RULES = tuple(sharding.RULES)  # the tables in mdlm_jax/parallel/sharding.py
MESH_AXES = ("data", "fsdp", "sequence", "tensor")


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # "mdlm": masked diffusion NELBO on a bidirectional model.
  # "ar": next-token loss on the same network with model.causal=True.
  c.objective = "mdlm"

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = -1  # -1: taken from the tokenizer.
  m.num_layers = 8
  m.embed_dim = 384
  m.num_heads = 6
  m.head_dim = -1  # -1: embed_dim // num_heads.
  m.num_kv_heads = -1  # -1: num_heads; fewer: grouped-query attention (the KV cache shrinks with it).
  m.qkv_bias = False  # biases on the q/k/v projections (Qwen2/Dream have them).
  m.mlp_dim = 1024
  m.mlp = "swiglu"
  m.causal = False
  # Hidden state i - 1 scores token i (Dream; keeps an AR initialisation's head useful).
  m.shift_logits = False
  m.time_conditioning = False  # adaLN conditioning on t, as in MDLM's DiT.
  m.cond_dim = 128
  m.tie_embeddings = True
  # A tied head scales logits by embed_dim ** -0.5 (LLaDA); False: Llama's plain tied head.
  m.scale_tied_logits = True
  m.qk_norm = False  # RMSNorm on each query/key head before RoPE (Qwen3).
  # An AR model adapted to block diffusion (A2D.md): clean tokens attend causally,
  # as the base did; only the block being denoised attends both ways.
  m.clean_causal = False
  # Low-rank adapters on every linear layer, acting on the tokens being denoised
  # only (0: none); train.trainable="adapters" trains them alone.
  m.lora_rank = 0
  m.lora_alpha = 16.0
  m.rope_theta = 10000.0
  # Stretching RoPE past the trained context (model/rope.py): type "linear",
  # "dynamic", "yarn" or "llama3" with `factor` and `max_position`, the
  # context the model was trained at (configs/extend_context.py fine-tunes with it).
  m.rope_scaling = ml_collections.ConfigDict(dataclasses.asdict(RopeScaling()))
  m.norm_eps = 1e-6
  m.dtype = "float32"  # compute dtype; params are always float32.
  m.attention = "xla"
  m.remat = False

  c.diffusion = d = ml_collections.ConfigDict()
  d.schedule = "loglinear"
  d.eps = 1e-3  # alpha(1) = eps: the noise schedule never reaches exactly 0.
  d.sampling_eps = 1e-3  # t ~ U[sampling_eps, 1] during training.
  d.antithetic = True
  # Training draws t in [max(sampling_eps, train_t_min), train_t_max]: below 1 and
  # above 0 it is BD3-LM's clipped schedule (less gradient variance, a biased
  # bound). Evaluation and the logged validation NELBO always use [sampling_eps, 1].
  d.train_t_min = 0.0
  d.train_t_max = 1.0
  # > 0: block diffusion (BD3-LM) with blocks of this many tokens; 0: plain MDLM.
  d.block_size = 0
  # Training an adapted AR model (model.clean_causal): weight in [0, 1] of the
  # KL to the clean stream's own next-token distribution (the frozen base's
  # when only adapters train) against the masked-token NELBO. Not in the bound.
  d.distill_weight = 0.0
  # Block diffusion, training only: each row also seen with the complement of
  # its masks, so every token is scored in one of the two views (twice the
  # compute a row; the term is the views' mean).
  d.complementary_masks = False
  # Block diffusion, training only: position-dependent mask rates. A block's
  # tokens are masked at times from (1 - slope) t to (1 + slope) t, left to right,
  # so its left is in view more often, as when a block decodes left to right.
  d.position_mask_slope = 0.0
  # An adapted AR model trained whole (train.trainable="all"): weight of the AR
  # loss on the clean stream (its next-token NLL on the scored tokens), which
  # keeps the base's own predictions while its weights move. Not in the bound.
  d.ar_weight = 0.0

  c.data = dt = ml_collections.ConfigDict()
  dt.corpus = "stdlib"  # "stdlib", a folder, a glob of text files, or a .jsonl file.
  dt.text_field = "text"  # for jsonl corpora.
  dt.validation_fraction = 0.05
  dt.seq_len = 256
  dt.batch_size = 32  # global batch, summed over processes.
  # Reader shards the documents are dealt into; each process reads
  # num_shards / process_count of them. 0: one per process. A fixed value
  # (dividing every process count you use) makes the global batches the same
  # whatever the number of processes.
  dt.num_shards = 0
  dt.shuffle_seed = 0
  dt.tokenizer = ""  # path to a sentencepiece .model; "" trains one into the workdir.
  dt.tokenizer_vocab_size = 4096
  dt.tokenizer_max_chars = 20_000_000  # of training text fed to the tokenizer trainer.
  # Fill-in-the-middle (data/fim.py): the fraction of training documents cut
  # into prefix, middle and suffix and rearranged, and of those the fraction in
  # SPM rather than PSM order. > 0 needs the FIM pieces in the tokenizer, and
  # makes the engine and the CLI infill in that format. In a chat run
  # (data.kind) it is the share of rows drawn from the folder's infill
  # records, which are cut already and always PSM (the engine's prompt).
  dt.fim_rate = 0.0
  dt.fim_spm_rate = 0.5
  # "document": each document is cut before packing; "context": each run of
  # text in a packed row is cut after packing, so every example fits in a
  # row (for documents longer than seq_len, as source files mostly are).
  dt.fim_level = "document"
  # The chat template the model is trained for ("" none, or a name in
  # data/chat_template.BUILT_IN); exports write it beside the weights.
  dt.chat_template = ""
  # "text": documents packed into rows (pretraining); "chat": instruction
  # tuning on conversations (data/chat.py), data.corpus a folder with
  # train.jsonl and heldout.jsonl (python -m mdlm_jax.corpus instructions).
  dt.kind = "text"
  # Chat runs: row lengths below seq_len, e.g. "256,512". A batch then holds
  # rows of one length bucket cut to it, so short answers do not pay for a
  # full row of padding (data/chat.py). "" keeps every row seq_len long.
  dt.length_buckets = ""

  c.optim = o = ml_collections.ConfigDict()
  o.learning_rate = 1e-3
  o.warmup_steps = 200
  o.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio.
  o.weight_decay = 0.01
  o.b1 = 0.9
  o.b2 = 0.98
  o.eps = 1e-8
  o.grad_clip = 1.0  # global norm; 0 disables.
  o.grad_accum_steps = 1
  o.ema_decay = 0.999  # 0 disables the EMA.

  c.train = t = ml_collections.ConfigDict()
  t.num_steps = 2000
  t.log_every = 20
  t.checkpoint_every = 200
  t.keep_checkpoints = 3
  t.eval_every = 0  # 0: evaluate only at the end.
  t.eval_batches = 8
  t.peak_flops_per_device = 0.0  # for MFU; 0: spec sheet, or measured on CPU.
  # A checkpoint or params-only folder whose weights start a fresh run (e.g. an
  # AR model adapted to diffusion); same network shape and tokenizer required.
  t.init_from = ""
  # "all" parameters, or the "adapters" alone (model.lora_rank > 0): the base stays frozen
  # and computes no weight gradients.
  t.trainable = "all"

  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = -1  # -1: all devices not used by the other axes.
  ms.fsdp = 1
  # Sequence parallelism: activations split along the sequence, attention
  # gathers keys and values (kernels/sequence_parallel.py); for contexts whose
  # activations do not fit one device.
  ms.sequence = 1
  ms.tensor = 1

  # How logical axes map onto the mesh: "fsdp_tp" (weights over fsdp on embed,
  # over tensor on heads/mlp/vocab) or "fsdp" (over fsdp only; mesh.tensor=1).
  c.sharding = sh = ml_collections.ConfigDict()
  sh.rules = "fsdp_tp"

  c.eval = e = ml_collections.ConfigDict()
  e.num_batches = 16
  e.time_samples = 4  # Monte Carlo t samples per sequence for the NELBO.
  e.seed = 1234
  return c


def parse_buckets(text: str) -> tuple[int, ...]:
  """'256,512' -> (256, 512); '' -> ()."""
  if not str(text).strip():
    return ()
  try:
    return tuple(sorted(int(x) for x in str(text).split(",")))
  except ValueError:
    raise ValueError(f"length_buckets must be comma-separated integers like '256,512', got {text!r}") from None


def parse_mesh(text: str) -> dict[str, int]:
  """'data=2,fsdp=64' -> {"data": 2, "fsdp": 64, "tensor": 1}; axes left out are 1."""
  try:
    sizes = {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
  except ValueError:
    raise ValueError(f"mesh must look like 'data=2,fsdp=4,sequence=1,tensor=2', got {text!r}") from None
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh axes are {', '.join(MESH_AXES)}; got {unknown} in {text!r}")
  bad = {k: v for k, v in sizes.items() if v < 1}
  if bad:
    raise ValueError(f"mesh sizes must be positive, got {bad} in {text!r}")
  return {a: sizes.get(a, 1) for a in MESH_AXES}


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file, e.g. to build one config on another."""
  import importlib.util
  import os
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def complete(saved) -> ml_collections.ConfigDict:
  """A config read back (a checkpoint's, an export's) merged over
  `base_config()`: a field it lacks was added after it was written, and it
  trained with that field's default. Every reader can then name any field.
  Fields this version does not know are kept."""
  def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
      out[k] = merge(base[k], v) if isinstance(base.get(k), dict) and isinstance(v, dict) else v
    return out
  saved = saved.to_dict() if isinstance(saved, ml_collections.ConfigDict) else dict(saved)
  return ml_collections.ConfigDict(merge(base_config().to_dict(), saved))


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field."""


def _check(cond: bool, field: str, msg: str):
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises ConfigError naming the first bad field; returns the config."""
  _check(c.objective in OBJECTIVES, "objective", f"must be one of {OBJECTIVES}, got {c.objective!r}")
  m = c.model
  for f in ("num_layers", "embed_dim", "num_heads", "mlp_dim"):
    _check(isinstance(m[f], int) and m[f] > 0, f"model.{f}", f"must be a positive int, got {m[f]!r}")
  _check(m.vocab_size == -1 or m.vocab_size > 4, "model.vocab_size", f"must be -1 or > 4, got {m.vocab_size}")
  if m.head_dim == -1:
    _check(m.embed_dim % m.num_heads == 0, "model.embed_dim",
           f"{m.embed_dim} is not divisible by model.num_heads={m.num_heads}")
  else:
    _check(m.head_dim > 0, "model.head_dim", f"must be -1 or positive, got {m.head_dim}")
  kvh = m.num_kv_heads
  _check(kvh == -1 or (isinstance(kvh, int) and kvh > 0 and m.num_heads % kvh == 0), "model.num_kv_heads",
         f"must be -1 or a positive divisor of model.num_heads={m.num_heads}, got {kvh!r}")
  hd = m.head_dim if m.head_dim != -1 else m.embed_dim // m.num_heads
  _check(hd % 2 == 0, "model.head_dim", f"RoPE needs an even head dim, got {hd}")
  _check(m.mlp in MLPS, "model.mlp", f"must be one of {MLPS}, got {m.mlp!r}")
  _check(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {m.dtype!r}")
  _check(m.attention in ATTENTION, "model.attention", f"must be one of {ATTENTION}, got {m.attention!r}")
  _check(m.rope_theta > 0, "model.rope_theta", "must be positive")
  try:
    RopeScaling.from_dict(m.rope_scaling.to_dict() if "rope_scaling" in m else None)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.model.rope_scaling: {e}") from None
  if c.objective == "ar":
    _check(m.causal, "model.causal", "objective 'ar' needs a causal model (set model.causal=True)")
    _check(not m.shift_logits, "model.shift_logits", "an AR model already scores the next token")
    _check(not m.time_conditioning, "model.time_conditioning", "an AR model has no diffusion time")
  else:
    _check(not m.causal, "model.causal", "objective 'mdlm' needs a bidirectional model (model.causal=False)")

  d = c.diffusion
  _check(d.schedule in SCHEDULES, "diffusion.schedule", f"must be one of {SCHEDULES}, got {d.schedule!r}")
  _check(0 < d.eps < 1, "diffusion.eps", f"must be in (0, 1), got {d.eps}")
  _check(0 <= d.sampling_eps < 1, "diffusion.sampling_eps", f"must be in [0, 1), got {d.sampling_eps}")
  lo, hi = d.train_t_min, d.train_t_max
  _check(0 < hi <= 1, "diffusion.train_t_max", f"must be in (0, 1], got {hi}")
  _check(0 <= lo < hi and d.sampling_eps < hi, "diffusion.train_t_min",
         f"must be >= 0 and below train_t_max={hi} (and sampling_eps={d.sampling_eps} below it too), got {lo}")

  rank = m.lora_rank
  _check(isinstance(rank, int) and rank >= 0, "model.lora_rank", f"must be an int >= 0, got {rank!r}")
  _check(m.lora_alpha > 0, "model.lora_alpha", f"must be positive, got {m.lora_alpha}")
  trainable = c.train.trainable
  _check(trainable in ("all", "adapters"), "train.trainable", f"must be 'all' or 'adapters', got {trainable!r}")
  _check(trainable == "all" or rank > 0, "train.trainable", "'adapters' needs model.lora_rank > 0")
  if m.clean_causal:
    _check(c.objective == "mdlm" and d.block_size > 0 and m.shift_logits,
           "model.clean_causal", "an adapted AR model is a block-diffusion model (diffusion.block_size > 0) with a"
           " shifted head (model.shift_logits=True)")

  _check(isinstance(d.complementary_masks, bool), "diffusion.complementary_masks", "must be a boolean")
  _check(not d.complementary_masks or d.block_size > 0, "diffusion.complementary_masks",
         "applies to block diffusion (diffusion.block_size > 0)")
  slope = d.position_mask_slope
  _check(isinstance(slope, (int, float)) and 0.0 <= slope < 1.0, "diffusion.position_mask_slope",
         f"must be in [0, 1), got {slope!r}")
  _check(not slope or d.block_size > 0, "diffusion.position_mask_slope",
         "applies to block diffusion (diffusion.block_size > 0)")
  _check(not (slope and d.complementary_masks), "diffusion.position_mask_slope",
         "complementary masks mirror a block's time; position-dependent masking gives each token its own")
  _check(isinstance(d.ar_weight, (int, float)) and d.ar_weight >= 0, "diffusion.ar_weight",
         f"must be >= 0, got {d.ar_weight!r}")
  _check(not d.ar_weight or (m.clean_causal and c.train.trainable == "all"), "diffusion.ar_weight",
         "the AR loss trains the base's own weights: it needs model.clean_causal=True and train.trainable='all'")
  lam = d.distill_weight
  _check(0.0 <= lam <= 1.0, "diffusion.distill_weight", f"must be in [0, 1], got {lam}")
  _check(not lam or m.clean_causal, "diffusion.distill_weight",
         "distillation reads the AR model's clean stream: it needs model.clean_causal=True")

  dt = c.data
  _check(isinstance(dt.corpus, str) and dt.corpus, "data.corpus", "must be 'stdlib' or a path")
  _check(0 < dt.validation_fraction < 1, "data.validation_fraction", f"must be in (0, 1), got {dt.validation_fraction}")
  _check(dt.seq_len >= 8, "data.seq_len", f"must be >= 8, got {dt.seq_len}")
  _check(dt.batch_size > 0, "data.batch_size", f"must be positive, got {dt.batch_size}")
  bs = d.block_size
  _check(isinstance(bs, int) and bs >= 0, "diffusion.block_size", f"must be an int >= 0 (0 = plain MDLM), got {bs!r}")
  if bs > 0:
    _check(c.objective != "ar", "diffusion.block_size", "block diffusion is a diffusion objective; set it to 0 for 'ar'")
    _check(not m.time_conditioning, "model.time_conditioning",
           "block diffusion samples one t per block but the model is conditioned on one t per sequence;"
           " set model.time_conditioning=False")
    _check(dt.seq_len % bs == 0, "diffusion.block_size", f"{bs} does not divide data.seq_len={dt.seq_len}")
  _check(dt.kind in ("text", "chat"), "data.kind", f"must be 'text' or 'chat', got {dt.kind!r}")
  if dt.kind == "chat":
    _check(dt.chat_template, "data.chat_template", "a chat run renders its conversations with a template:"
           " set it to 'chatml'")
  try:
    buckets = parse_buckets(dt.length_buckets)
  except ValueError as e:
    raise ConfigError(f"config.data.{e}") from None
  if buckets:
    _check(dt.kind == "chat", "data.length_buckets",
           "only chat runs have rows of their own lengths (text runs pack every row full)")
    _check(all(8 <= b < dt.seq_len for b in buckets), "data.length_buckets",
           f"each bucket must be in [8, seq_len={dt.seq_len}), got {buckets}")
    _check(not bs or all(b % bs == 0 for b in buckets), "data.length_buckets",
           f"each bucket must be a multiple of diffusion.block_size={bs}, got {buckets}")
  from mdlm_jax.data.chat_template import BUILT_IN  # pylint: disable=import-outside-toplevel
  _check(dt.chat_template in ("", *BUILT_IN), "data.chat_template",
         f"must be '' or one of {sorted(BUILT_IN)}, got {dt.chat_template!r}")
  for name in ("fim_rate", "fim_spm_rate"):
    v = dt.get(name, 0.0)
    _check(isinstance(v, (int, float)) and 0 <= v <= 1, f"data.{name}", f"must be in [0, 1], got {v!r}")
  _check(dt.fim_level in ("document", "context"), "data.fim_level",
         f"must be 'document' or 'context', got {dt.get('fim_level')!r}")
  _check(dt.tokenizer_vocab_size >= 300, "data.tokenizer_vocab_size",
         f"must be >= 300 (256 byte pieces + specials + merges), got {dt.tokenizer_vocab_size}")

  o = c.optim
  _check(o.learning_rate > 0, "optim.learning_rate", f"must be positive, got {o.learning_rate}")
  _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
  _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
  _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
  _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1", "b1 and b2 must be in [0, 1)")
  _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables)")
  _check(isinstance(o.grad_accum_steps, int) and o.grad_accum_steps >= 1, "optim.grad_accum_steps", "must be an int >= 1")
  _check(0 <= o.ema_decay < 1, "optim.ema_decay", f"must be in [0, 1), got {o.ema_decay}")

  t = c.train
  _check(t.num_steps > 0, "train.num_steps", f"must be positive, got {t.num_steps}")
  _check(t.log_every > 0, "train.log_every", "must be positive")
  _check(t.checkpoint_every > 0, "train.checkpoint_every", "must be positive")
  _check(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
  _check(t.eval_every >= 0, "train.eval_every", "must be >= 0")

  for ax in MESH_AXES:
    v = c.mesh.get(ax, 1)
    _check(v == -1 or v >= 1, f"mesh.{ax}", f"must be -1 or a positive int, got {v}")
  _check(sum(c.mesh.get(a, 1) == -1 for a in MESH_AXES) <= 1, "mesh", "at most one axis may be -1")
  seq = c.mesh.sequence
  _check(seq == -1 or dt.seq_len % seq == 0, "mesh.sequence",
         f"must divide data.seq_len={dt.seq_len}, got {seq}")
  _check(dt.num_shards >= 0, "data.num_shards", f"must be >= 0 (0 = one per process), got {dt.num_shards}")
  rules = c.sharding.rules
  _check(rules in SHARDING_RULES, "sharding.rules", f"must be one of {SHARDING_RULES}, got {rules!r}")
  if rules == "fsdp":
    _check(c.mesh.tensor == 1, "mesh.tensor",
           f"sharding.rules='fsdp' puts nothing on the tensor axis, so it must be 1 (got {c.mesh.tensor});"
           " use sharding.rules='fsdp_tp' for tensor parallelism")
  _check(c.eval.time_samples >= 1, "eval.time_samples", "must be >= 1")
  _check(c.eval.num_batches >= 1, "eval.num_batches", "must be >= 1")
  return c
