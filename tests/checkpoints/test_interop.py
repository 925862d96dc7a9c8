"""LLaDA/Dream-layout export and import: exact round trips, sharding, errors, and
logits against transformers' Llama/Qwen2 on the same weights (the `interop` extra)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import REPO, load_config, xla_flags
from mdlm_jax.checkpoints import interop, packaged, params_only, safetensors
from mdlm_jax import checkpoints
from mdlm_jax.model.spec import bind, model_spec
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model import ModelConfig
from mdlm_jax.data.tokenizer import Tokenizer

# GQA (4 query heads on 2 kv heads), q/k/v biases and an untied head: every option the layouts need.
GQA = dict(num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=48, qkv_bias=True,
           tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_file(os.path.join(packaged.path(packaged.DIFFUSION), "tokenizer.model"))


def make(tok, seed=0, **model):
  """(config, float32 params) of a tiny model with random weights, norm scales and biases included."""
  c = load_config("tiny")
  c.model.update(**{**GQA, **model})
  c.data.update(seq_len=32, tokenizer_vocab_size=tok.vocab_size)
  cfg = ModelConfig.from_config(c.model, vocab_size=tok.vocab_size)
  spec = model_spec(cfg, None)
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    name = getattr(path[-1], "key", "")
    scale = 1.0 if name == "embedding" else 0.3 if name in ("scale", "bq", "bk", "bv") else x.shape[0] ** -0.5
    w = (1.0 if name == "scale" else 0.0) + scale * rng.normal(size=x.shape)
    return jnp.asarray(w, jnp.float32)

  return c, jax.tree_util.tree_map_with_path(leaf, spec.abstract)


def flat(params):
  return {k: np.asarray(v) for k, v in params_only.flatten(params).items()}


def logits(loaded_or_spec, params, tokens):
  return np.asarray(bind(loaded_or_spec, params)(jnp.asarray(tokens)))


@pytest.mark.parametrize("fmt", interop.FORMATS)
def test_round_trip_is_exact(fmt, tok, tmp_path):
  """export -> checkpoints.load of the folder -> import -> native: every parameter bit-identical."""
  c, params = make(tok)
  out = interop.save(str(tmp_path / fmt), fmt, params, c, tok, step=7, dtype="float32")
  hf = json.load(open(os.path.join(out, "config.json")))
  assert hf["mask_token_id"] == tok.mask_id and hf["eos_token_id"] == tok.eos_id
  assert json.load(open(os.path.join(out, "tokenizer_config.json")))["mask_token"] == "[MASK]"
  loaded = checkpoints.load(out)  # reads the Hugging Face layout directly
  assert loaded.step == 7 and loaded.spec.cfg == ModelConfig.from_config(c.model, vocab_size=tok.vocab_size)
  want = flat(params)
  got = flat(loaded.params)
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  from mdlm_jax import export
  export.main(["--import", f"--checkpoint={out}", f"--out={tmp_path / 'native'}", "--dtype=float32"])
  back = checkpoints.load(str(tmp_path / "native"))
  assert back.config.diffusion.to_dict() == c.diffusion.to_dict()
  for k, v in flat(back.params).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_dream_tied_and_bias_free_model(tok, tmp_path):
  """A tied head becomes Dream's explicit lm_head with our logit scale folded in;
  the zero q/k/v biases Qwen2 needs are dropped again on import."""
  c, params = make(tok, tie_embeddings=True, qkv_bias=False, num_kv_heads=-1)
  out = interop.save(str(tmp_path / "d"), "dream", params, c, tok, step=0, dtype="float32")
  tensors, _ = safetensors.load_folder(out)
  assert not tensors["model.layers.1.self_attn.k_proj.bias"].any()
  loaded = checkpoints.load(out)
  assert not loaded.spec.cfg.qkv_bias and not loaded.spec.cfg.tie_embeddings
  tokens = np.random.default_rng(0).integers(0, tok.vocab_size, (2, 12))
  spec = model_spec(ModelConfig.from_config(c.model, vocab_size=tok.vocab_size), None)
  np.testing.assert_allclose(logits(loaded.spec, loaded.params, tokens), logits(spec, params, tokens),
                             rtol=1e-5, atol=1e-5)


def test_llada_tied_model_round_trips_tied(tok, tmp_path):
  """Our tied head is LLaDA's weight_tying + scale_logits: it stays tied and exact."""
  c, params = make(tok, tie_embeddings=True)
  out = interop.save(str(tmp_path / "l"), "llada", params, c, tok, step=0, dtype="float32")
  hf = json.load(open(os.path.join(out, "config.json")))
  assert hf["weight_tying"] and hf["scale_logits"]
  loaded = checkpoints.load(out)
  assert loaded.spec.cfg.tie_embeddings
  for k, v in flat(loaded.params).items():
    np.testing.assert_array_equal(v, flat(params)[k])


def test_sharded_export_and_native_alias(tok, tmp_path, tiny_checkpoints):
  """--max-shard-size splits the weights into HF-named shards plus an index, for every format."""
  from mdlm_jax import export
  src = checkpoints.load(tiny_checkpoints["mdlm"])
  for fmt in ("params", "llada", "dream"):
    out = tmp_path / fmt
    export.main([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--out={out}", f"--format={fmt}",
                 "--max-shard-size=40KB", "--dtype=float32"])
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", files
    assert "model.safetensors" not in files
    index = json.load(open(out / safetensors.INDEX_FILE))
    assert set(index["weight_map"].values()) == set(shards)
    for f in shards:  # under the limit, or one tensor that is larger by itself
      assert os.path.getsize(out / f) < 41_000 or list(index["weight_map"].values()).count(f) == 1, f
    loaded = checkpoints.load(str(out))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, src.tokenizer.vocab_size, (2, 16)))
    np.testing.assert_allclose(np.asarray(loaded.model(tokens)), np.asarray(src.model(tokens)),
                               rtol=2e-5, atol=2e-5)


def _run_export(*args):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  return subprocess.run([sys.executable, "-m", "mdlm_jax.export", *args], capture_output=True, text=True,
                        env=env, timeout=240, cwd=REPO)


def test_errors_name_the_problem(tok, tmp_path):
  c, params = make(tok)
  out = interop.save(str(tmp_path / "m"), "llada", params, c, tok, step=0, dtype="float32")
  tensors, _ = safetensors.load_folder(out)

  def broken(name, edit):
    d = tmp_path / name
    interop.save(str(d), "llada", params, c, tok, step=0, dtype="float32")
    edit(d)
    return str(d)

  missing = broken("missing", lambda d: safetensors.save(
      str(d / "model.safetensors"), {k: v for k, v in tensors.items() if "blocks.1.up_proj" not in k}))
  with pytest.raises(interop.InteropError, match=r"tensor model.transformer.blocks.1.up_proj.weight is missing"):
    checkpoints.load(missing)
  shape = broken("shape", lambda d: safetensors.save(
      str(d / "model.safetensors"), {**tensors, "model.transformer.blocks.0.k_proj.weight": np.zeros((32, 32))}))
  with pytest.raises(interop.InteropError, match=r"k_proj.weight has shape \(32, 32\), the config gives \(16, 32\)"):
    checkpoints.load(shape)
  extra = broken("extra", lambda d: safetensors.save(str(d / "model.safetensors"), {**tensors, "x.y": np.ones(2)}))
  with pytest.raises(interop.InteropError, match=r"unexpected tensors \['x.y'\]"):
    checkpoints.load(extra)

  with pytest.raises(interop.InteropError, match="has no tokenizer.model or tokenizer.json; pass --tokenizer=PATH"):
    interop.read(broken("notok", lambda d: os.remove(d / "tokenizer.model")))

  def option(d):
    hf = json.load(open(d / "config.json"))
    json.dump({**hf, "activation_type": "gelu"}, open(d / "config.json", "w"))
  with pytest.raises(interop.InteropError, match="activation_type='gelu' is not supported"):
    checkpoints.load(broken("option", option))
  c_t, params_t = make(tok, time_conditioning=True)
  with pytest.raises(interop.InteropError, match="model.time_conditioning"):
    interop.save(str(tmp_path / "t"), "llada", params_t, c_t, tok, step=0)
  with pytest.raises(interop.InteropError, match="unknown format 'gguf'"):
    interop.to_hf("gguf", params, ModelConfig.from_config(c.model, vocab_size=tok.vocab_size))
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
  from mdlm_jax import export
  with pytest.raises(SystemExit):
    export.parse([f"--checkpoint={out}", f"--out={tmp_path / 'x'}", "--format=onnx"])
  with pytest.raises(ValueError, match="--format=gguf is read with --import"):
    export.export_folder(export.parse([f"--checkpoint={out}", f"--out={tmp_path / 'x'}", "--format=gguf"]), 2**30)
  with pytest.raises(ValueError, match="holds a llada checkpoint"):
    export.import_folder(export.parse(["--import", "--format=dream", f"--checkpoint={out}", f"--out={tmp_path / 'x'}"]),
                   2**30)
  # the CLI: one line, non-zero exit, nothing written
  r = _run_export("--import", f"--checkpoint={missing}", f"--out={tmp_path / 'x'}")
  assert r.returncode != 0 and "up_proj.weight is missing" in r.stderr and "Traceback" not in r.stderr
  r = _run_export(f"--checkpoint={out}", f"--out={tmp_path / 'x'}", "--format=dream", "--max-shard-size=lots")
  assert r.returncode != 0 and "--max-shard-size" in r.stderr and "Traceback" not in r.stderr
  assert not (tmp_path / "x").exists()


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_gqa_kv_cache_holds_only_kv_heads(tok):
  """The cache stores 2 kv heads for 4 query heads, and cached decoding matches the full forward."""
  c, params = make(tok)
  c.model.causal = True
  cfg = ModelConfig.from_config(c.model, vocab_size=tok.vocab_size)
  spec = model_spec(cfg, None)
  model = bind(spec, params)
  cache = KVCache.init(cfg, 2, 12)
  assert cache.k.shape == (2, 2, 2, 8, 12)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, tok.vocab_size, (2, 12)))
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  full = np.asarray(model(tokens))
  got, cache = model.forward_cached(tokens[:, :8], pos[:, :8], cache, commit=True)
  np.testing.assert_allclose(np.asarray(got), full[:, :8], rtol=1e-5, atol=1e-5)
  got, cache = model.forward_cached(tokens[:, 8:], pos[:, 8:], cache, commit=True)
  np.testing.assert_allclose(np.asarray(got), full[:, 8:], rtol=1e-5, atol=1e-5)


# ---- against transformers (pip install mdlm_jax[interop]) ----

def _torch_logits(fmt, folder, tokens):
  """Logits of transformers' Llama (for LLaDA) or Qwen2 (for Dream) on our exported
  weights, with a 4-D float mask of zeros: every query sees every key."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf = json.load(open(os.path.join(folder, "config.json")))
  tensors, _ = safetensors.load_folder(folder)
  if fmt == "llada":
    d, h = hf["d_model"], hf["n_heads"]
    config = transformers.LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=d, intermediate_size=hf["mlp_hidden_size"],
        num_hidden_layers=hf["n_layers"], num_attention_heads=h, num_key_value_heads=hf["n_kv_heads"],
        head_dim=d // h, rms_norm_eps=hf["rms_norm_eps"], attention_bias=hf["include_qkv_bias"],
        tie_word_embeddings=False, rope_theta=hf["rope_theta"], max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    renames = {"model.transformer.wte.": "model.embed_tokens.", "model.transformer.ln_f.": "model.norm.",
               "model.transformer.ff_out.": "lm_head.", "model.transformer.blocks.": "model.layers.",
               ".q_proj.": ".self_attn.q_proj.", ".k_proj.": ".self_attn.k_proj.", ".v_proj.": ".self_attn.v_proj.",
               ".attn_out.": ".self_attn.o_proj.", ".attn_norm.": ".input_layernorm.",
               ".ff_norm.": ".post_attention_layernorm.", ".ff_proj.": ".mlp.gate_proj.",
               ".up_proj.": ".mlp.up_proj.", ".ff_out.": ".mlp.down_proj."}
    state = {}
    for name, a in tensors.items():
      for old, new in renames.items():
        name = name.replace(old, new)
      state[name] = torch.from_numpy(np.asarray(a, np.float32))
    if hf["include_qkv_bias"]:  # Llama's attention_bias also puts one on o_proj
      for i in range(hf["n_layers"]):
        state[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(d)
  else:
    config = transformers.Qwen2Config(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"], rms_norm_eps=hf["rms_norm_eps"],
        tie_word_embeddings=False, rope_theta=hf["rope_theta"], max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(config)
    state = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in tensors.items()}
  model.config._attn_implementation = "eager"
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
  model.eval()
  ids = torch.from_numpy(np.asarray(tokens, np.int64))
  b, l = ids.shape
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=torch.zeros(b, 1, l, l), use_cache=False)
  return out.logits.float().numpy()


@pytest.mark.slow  # torch forward of each layout; Llama/Qwen imports are checked against transformers in CI
@pytest.mark.parametrize("fmt", interop.FORMATS)
def test_logits_match_transformers(fmt, tok, tmp_path):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  c, params = make(tok, seed=3)
  out = interop.save(str(tmp_path / fmt), fmt, params, c, tok, step=0, dtype="float32")
  tokens = np.random.default_rng(4).integers(0, tok.vocab_size, (2, 24))
  loaded = checkpoints.load(out)
  ours = logits(loaded.spec, loaded.params, tokens)
  theirs = _torch_logits(fmt, out, tokens)
  assert ours.shape == theirs.shape
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_num_kv_heads_must_divide_num_heads():
  from mdlm_jax import config as config_lib
  c = load_config("tiny")
  c.model.num_kv_heads = 3
  with pytest.raises(config_lib.ConfigError, match="model.num_kv_heads: must be -1 or a positive divisor of"
                                                   " model.num_heads=4, got 3"):
    config_lib.validate(c)


# ---- Hugging Face tokenizer.json (the published LLaDA/Dream checkpoints'; needs `tokenizers`) ----

HF_TEXTS = ["def f(x):\n  return x + 1\n", "hello world, héllo 日本\t tabs\n\n", "class A:\n    pass\n"]
HF_SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|mdm_mask|>"]  # ids 0, 1, 2 (LLaDA's names)
HF_ROWS = 320  # embedding rows past the tokenizer's own ids, as the releases pad theirs


@pytest.fixture(scope="module")
def hf_json():
  """A tiny byte-level BPE tokenizer.json, trained here in milliseconds."""
  pytest.importorskip("tokenizers")
  from tests.byte_bpe import byte_level_bpe_json
  return byte_level_bpe_json(HF_TEXTS * 4, 300, HF_SPECIALS)


@pytest.fixture(scope="module")
def hf_tok(hf_json):
  from mdlm_jax.data.hf_tokenizer import HFTokenizer
  return HFTokenizer(hf_json, {"mask_token_id": 2, "bos_token_id": 1, "eos_token_id": 0, "vocab_size": HF_ROWS})


def published_llada(hf_tok, hf_json, folder, seed=5):
  """(config, params, folder) of a LLaDA folder shaped like GSAI-ML's: tokenizer.json, no tokenizer.model,
  config.json with mask/eos/pad ids only and no "mdlm_jax" key, BOS named in tokenizer_config.json."""
  c, params = make(hf_tok, seed=seed)
  out = interop.save(str(folder), "llada", params, c, hf_tok, step=0, dtype="float32")
  assert open(os.path.join(out, "tokenizer.json")).read() == hf_json
  assert not os.path.exists(os.path.join(out, "tokenizer.model"))
  hf = json.load(open(os.path.join(out, "config.json")))
  for key in ("mdlm_jax", "bos_token_id"):
    del hf[key]
  json.dump(hf, open(os.path.join(out, "config.json"), "w"))
  json.dump({"bos_token": {"content": "<|startoftext|>", "special": True}, "eos_token": "<|endoftext|>",
             "tokenizer_class": "PreTrainedTokenizerFast"}, open(os.path.join(out, "tokenizer_config.json"), "w"))
  return c, params, out


def test_hf_tokenizer_matches_tokenizers(hf_tok, hf_json):
  """encode/decode are the tokenizers library's own; special ids and padding rows decode to nothing;
  to_bytes round-trips through the loader checkpoints use, and tells the backends apart."""
  import pickle

  import tokenizers
  from mdlm_jax.data import tokenizer as tokenizer_lib
  from mdlm_jax.data.hf_tokenizer import HFTokenizer
  ref = tokenizers.Tokenizer.from_str(hf_json)
  assert (hf_tok.vocab_size, hf_tok.mask_id, hf_tok.bos_id, hf_tok.eos_id, hf_tok.pad_id) == (HF_ROWS, 2, 1, 0, 0)
  assert hf_tok.piece(2) == "<|mdm_mask|>" and hf_tok.piece(HF_ROWS - 1) == ""
  for text in [*HF_TEXTS, "unseen: ∑ 🙂 \u2581 x", ""]:
    ids = hf_tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False).ids
    assert hf_tok.decode(ids) == ref.decode(ids) == text
    assert hf_tok.decode([1, *ids, 2, HF_ROWS - 1, 0]) == text
  for other in (tokenizer_lib.load_bytes(hf_tok.to_bytes()), pickle.loads(pickle.dumps(hf_tok))):
    assert isinstance(other, HFTokenizer) and other.to_bytes() == hf_tok.to_bytes()
  sp = Tokenizer.from_file(os.path.join(packaged.path(packaged.DIFFUSION), "tokenizer.model"))
  assert isinstance(tokenizer_lib.load_bytes(sp.to_bytes()), Tokenizer)
  with pytest.raises(ValueError, match="holds a Hugging Face tokenizer.json"):
    Tokenizer.from_bytes(hf_tok.to_bytes())
  with pytest.raises(ValueError, match=f"token id {HF_ROWS} is outside the vocab"):
    hf_tok.decode([HF_ROWS])


@pytest.mark.slow  # two CLI processes; the folder tokenizer is checked in CI by the tests around it
def test_published_llada_folder_loads_samples_and_imports(hf_tok, hf_json, tmp_path):
  """checkpoints.load reads a tokenizer.json folder; the sample CLI runs on it; --import gives a native
  folder (tokenizer.json + ids in config.json) with identical params and tokenizer; export writes it back."""
  from mdlm_jax import export
  c, params, out = published_llada(hf_tok, hf_json, tmp_path / "llada")
  loaded = checkpoints.load(out)
  assert loaded.tokenizer.to_bytes() == hf_tok.to_bytes()  # BOS found through tokenizer_config.json
  want = flat(params)
  for k, v in flat(loaded.params).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.sample", f"--checkpoint={out}", "--prompt=def f(x):",
                      "--max-new-tokens", "8", "--effort=low"], capture_output=True, text=True, env=env,
                     timeout=240, cwd=REPO)
  assert r.returncode == 0 and r.stdout.startswith("def f(x):") and " forward passes" in r.stderr, r.stderr
  native = tmp_path / "native"
  export.main(["--import", f"--checkpoint={out}", f"--out={native}", "--dtype=float32"])
  assert sorted(os.listdir(native)) == ["config.json", "model.safetensors", "tokenizer.json"]
  meta = json.load(open(native / "config.json"))
  assert meta["version"] == 2 and meta["tokenizer"] == {"file": "tokenizer.json", **hf_tok.meta()}
  back = checkpoints.load(str(native))
  assert back.tokenizer.to_bytes() == hf_tok.to_bytes()
  for text in HF_TEXTS:
    assert back.tokenizer.encode(text) == hf_tok.encode(text)
    assert back.tokenizer.decode(hf_tok.encode(text)) == text
  for k, v in flat(back.params).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  again = tmp_path / "again"
  export.main([f"--checkpoint={native}", f"--out={again}", "--format=dream", "--dtype=float32"])
  assert (again / "tokenizer.json").read_text() == hf_json
  assert json.load(open(again / "tokenizer_config.json"))["mask_token"] == "<|mdm_mask|>"
  assert checkpoints.load(str(again)).tokenizer.to_bytes() == hf_tok.to_bytes()


def test_published_folder_tokenizer_errors(hf_tok, hf_json, tmp_path):
  c, params, out = published_llada(hf_tok, hf_json, tmp_path / "ok")
  hf = json.load(open(os.path.join(out, "config.json")))

  def variant(name, config=None, tokenizer_json=None):
    d = tmp_path / name
    shutil.copytree(out, d)
    if config is not None:
      json.dump(config, open(d / "config.json", "w"))
    if tokenizer_json is not None:
      (d / "tokenizer.json").write_text(tokenizer_json)
    return str(d)

  no_mask = variant("no_mask", {k: v for k, v in hf.items() if k != "mask_token_id"})
  with pytest.raises(interop.InteropError, match="no mask_token_id in config.json"):
    checkpoints.load(no_mask)
  with pytest.raises(interop.InteropError, match=f"mask_token_id=999 is outside the vocab \\[0, {HF_ROWS}\\)"):
    checkpoints.load(variant("big_mask", {**hf, "mask_token_id": 999}))
  with pytest.raises(interop.InteropError, match="tokenizer.json: not a Hugging Face tokenizer.json"):
    checkpoints.load(variant("garbled", tokenizer_json='{"model": '))
  r = _run_export("--import", f"--checkpoint={no_mask}", f"--out={tmp_path / 'x'}")
  assert r.returncode != 0 and "no mask_token_id" in r.stderr and "Traceback" not in r.stderr
  assert not (tmp_path / "x").exists()


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_rope_scaling_travels_through_the_dream_layout(tok, tmp_path):
  """A model extended with YaRN exports as Dream's `rope_scaling` and loads
  back with the same scaling and logits; LLaDA's config has no place for it."""
  from mdlm_jax.model.rope import RopeScaling
  yarn = RopeScaling(type="yarn", factor=4.0, max_position=32)
  c, params = make(tok, rope_scaling=dataclasses.asdict(yarn))
  out = interop.save(str(tmp_path / "d"), "dream", params, c, tok, step=0, dtype="float32")
  hf = json.load(open(os.path.join(out, "config.json")))
  assert hf["rope_scaling"]["rope_type"] == "yarn" and hf["max_position_embeddings"] == 32
  loaded = checkpoints.load(out)
  assert loaded.spec.cfg.rope_scaling == yarn
  tokens = np.random.default_rng(0).integers(0, tok.vocab_size, (1, 48))  # past the trained 32
  spec = model_spec(ModelConfig.from_config(c.model, vocab_size=tok.vocab_size), None)
  want = logits(spec, params, tokens)
  np.testing.assert_allclose(logits(loaded.spec, loaded.params, tokens), want, rtol=1e-5, atol=1e-5)
  plain = model_spec(dataclasses.replace(spec.cfg, rope_scaling=RopeScaling()), None)
  assert np.abs(logits(plain, params, tokens) - want).max() > 1e-3  # the scaling is not a no-op
  with pytest.raises(interop.InteropError, match="model.rope_scaling"):
    interop.save(str(tmp_path / "l"), "llada", params, c, tok, step=0, dtype="float32")
