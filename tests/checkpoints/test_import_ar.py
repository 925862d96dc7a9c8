"""Pretrained AR checkpoints in: Hugging Face Llama/Qwen2/Qwen3 folders against transformers,
GGUF files against a float64 numpy forward in llama.cpp's own layout, their tokenizers, errors."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.checkpoints import gguf_file, interop
from mdlm_jax.checkpoints.families import InteropError
from mdlm_jax.sampling.ar import ARSampler

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<jupyter_code>"]
CODE = ["def f(x):\n    return x ** 2 + 12345\n",
        "class Queue:\n    def push(self, item):\n        self.items.append(item)\n",
        "# héllo wörld 日本語 ✓ — emoji 🙂\nprint(f'{a!r:>10}')\n",
        "for i in range(10):\n\tif i % 3 == 0: continue\n"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def bpe():
  """A byte-level BPE as SmolLM2's: digits split one by one, then GPT-2's byte-level split."""
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tk.train_from_iterator(CODE * 8, trainer)
  return tk


FAMILIES = {
    # family: (config class, model class, extra config, tied head)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 12}, True),
}


def hf_model(family, vocab, seed):
  """A tiny random transformers model of `family`; every weight (norms and biases too) drawn at a
  scale that makes the logits far from uniform."""
  config_cls, model_cls, extra, tied = FAMILIES[family]
  config = getattr(transformers, config_cls)(
      vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=float(np.random.default_rng(seed).choice([1e4, 5e5])),
      tie_word_embeddings=tied, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, **extra)
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.3 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.3 * torch.randn_like(p))
      else:
        p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
  return model


def save_folder(model, bpe, folder):
  model.save_pretrained(folder, safe_serialization=True)
  bpe.save(os.path.join(folder, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "chat_template": TEMPLATE, "add_bos_token": False}
  json.dump(config, open(os.path.join(folder, "tokenizer_config.json"), "w"))
  return str(folder)


def torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_folder_logits_generation_and_tokenizer_match_transformers(family, bpe, tmp_path):
  model = hf_model(family, bpe.get_vocab_size(), seed=len(family))
  folder = save_folder(model, bpe, tmp_path / family)
  assert interop.hf_format(folder) == family
  loaded = checkpoints.load(folder)
  cfg = loaded.spec.cfg
  assert cfg.causal and loaded.config.objective == "ar"
  assert (cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings) == (family == "qwen3", family == "qwen2",
                                                            FAMILIES[family][3])
  tokens = np.random.default_rng(7).integers(0, bpe.get_vocab_size(), (2, 20))
  ours = np.asarray(loaded.model(jnp.asarray(tokens)))
  np.testing.assert_allclose(ours, torch_logits(model, tokens), rtol=1e-4, atol=1e-4)
  # The KV-cached AR decoder writes transformers' greedy continuation.
  prompt = tokens[:1, :6]
  out = ARSampler(8, temperature=0.0).generate(loaded.spec, loaded.params, jnp.asarray(prompt),
                                              jnp.ones(prompt.shape, bool), jax.random.key(0), eos_id=-1, pad_id=0)
  with torch.no_grad():
    ref = model.generate(torch.from_numpy(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
  assert np.asarray(out["tokens"])[0].tolist() == ref[0, 6:].tolist()
  # The tokenizer is the folder's, special ids from its config; [MASK] borrows a spare special token.
  # (AutoTokenizer would pick Qwen2's class by model_type and replace this test vocabulary's pre-tokenizer.)
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
  for text in CODE + ["<|im_start|>user\nhi<|im_end|>"]:
    assert loaded.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
  assert loaded.tokenizer.decode(loaded.tokenizer.encode(CODE[2])) == CODE[2]
  assert (loaded.tokenizer.bos_id, loaded.tokenizer.eos_id) == (1, 2)
  assert loaded.tokenizer.piece(loaded.tokenizer.mask_id) == "<jupyter_code>" and not loaded.tokenizer.adds_bos
  assert loaded.chat_template == TEMPLATE


def test_hf_folder_converts_to_params_only_and_reloads_exactly(bpe, tmp_path, capsys):
  from mdlm_jax import export
  model = hf_model("qwen3", bpe.get_vocab_size(), seed=3)
  folder = save_folder(model, bpe, tmp_path / "q3")
  out = tmp_path / "native"
  export.main(["--import", f"--checkpoint={folder}", f"--out={out}"])
  assert "float32" in capsys.readouterr().out
  a, b = checkpoints.load(folder), checkpoints.load(str(out))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, bpe.get_vocab_size(), (1, 12)))
  np.testing.assert_array_equal(np.asarray(a.model(tokens)), np.asarray(b.model(tokens)))
  assert b.tokenizer.mask_id == a.tokenizer.mask_id and not b.tokenizer.adds_bos and b.chat_template == TEMPLATE


def test_hf_folder_errors_name_the_problem(bpe, tmp_path):
  folder = save_folder(hf_model("llama", bpe.get_vocab_size(), seed=1), bpe, tmp_path / "ok")

  def variant(name, edit):
    d = tmp_path / name
    shutil.copytree(folder, d)
    edit(d)
    return str(d)

  def config_edit(**kw):
    def edit(d):
      c = json.load(open(d / "config.json"))
      c.update(kw)
      json.dump(c, open(d / "config.json", "w"))
    return edit

  with pytest.raises(InteropError, match="no config.json"):
    interop.read(variant("noconfig", lambda d: os.remove(d / "config.json")))
  with pytest.raises(InteropError, match=r"tensor model.layers.0.mlp.\w+_proj.weight has shape"):
    interop.read(variant("shape", config_edit(intermediate_size=96)))
  with pytest.raises(InteropError, match="model_type"):
    interop.read(variant("mamba", config_edit(model_type="mamba")))
  with pytest.raises(InteropError, match="hidden_act='gelu' is not supported"):
    interop.read(variant("gelu", config_edit(hidden_act="gelu")))
  with pytest.raises(InteropError, match="attention_bias=true"):
    interop.read(variant("obias", config_edit(attention_bias=True)))


# ---- GGUF ----

def write_gguf(path, model, bpe, *, arch="llama", types=None, chat_template=TEMPLATE):
  """`model` (a transformers Llama) as llama.cpp's converter writes it: its tensor names, q/k rows permuted
  for adjacent-pair RoPE, metadata keys and the tokenizer as metadata. `types`: GGUF name -> quant type."""
  c = model.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
  vocab = bpe.get_vocab()
  tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  special = set(SPECIALS)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(tokens)
  w.add_token_types([3 if t in special else 1 for t in tokens])
  w.add_token_merges([" ".join(m) for m in json.loads(bpe.to_str())["model"]["merges"]])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_add_bos_token(False)
  if chat_template:
    w.add_chat_template(chat_template)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  if c.tie_word_embeddings:
    state.pop("lm_head.weight", None)
  for name, a in state.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers."):].split(".", 1)
      module, kind = rest.rsplit(".", 1)
      out = f"blk.{i}.{per_layer[module]}.{kind}"
    else:
      out = names[name]
    if out.endswith(("attn_q.weight", "attn_k.weight")):
      heads = c.num_attention_heads if "attn_q" in out else c.num_key_value_heads
      a = gguf_file.permute_qk(a, heads)
    qtype = (types or {}).get(out, gguf.GGMLQuantizationType.F32)
    if qtype == gguf.GGMLQuantizationType.F32:
      w.add_tensor(out, np.ascontiguousarray(a, np.float32))
    else:
      w.add_tensor(out, gguf.quants.quantize(np.ascontiguousarray(a, np.float32), qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def numpy_reference(path, tokens):
  """Logits of a GGUF Llama computed in float64 straight from its dequantized tensors, llama.cpp's way:
  RoPE rotates adjacent pairs (the rows the converter permuted), so no permutation is undone here."""
  r = gguf.GGUFReader(path)
  meta = lambda k: r.fields[k].contents()  # noqa: E731
  t = {x.name: np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float64).reshape(
      [int(n) for n in reversed(x.shape)]) for x in r.tensors}
  h, g, eps = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv"), meta(
      "llama.attention.layer_norm_rms_epsilon")
  theta = meta("llama.rope.freq_base")
  norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w  # noqa: E731
  x = t["token_embd.weight"][tokens]
  l, d = x.shape
  k_dim = d // h
  pos = np.arange(l)[:, None] * theta ** (-np.arange(0, k_dim, 2) / k_dim)[None]  # [l, k/2]

  def rope_pairs(v):  # [l, heads, k]: (v[2j], v[2j+1]) rotated by pos[:, j]
    a, b = v[..., 0::2], v[..., 1::2]
    cos, sin = np.cos(pos)[:, None], np.sin(pos)[:, None]
    out = np.empty_like(v)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out

  for i in range(meta("llama.block_count")):
    p = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
    y = norm(x, p("attn_norm"))
    q = rope_pairs((y @ p("attn_q").T).reshape(l, h, k_dim))
    k = np.repeat(rope_pairs((y @ p("attn_k").T).reshape(l, g, k_dim)), h // g, axis=1)
    v = np.repeat((y @ p("attn_v").T).reshape(l, g, k_dim), h // g, axis=1)
    s = np.einsum("qhk,shk->hqs", q, k) / np.sqrt(k_dim) + np.triu(np.full((l, l), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hqs,shk->qhk", s / s.sum(-1, keepdims=True), v).reshape(l, d)
    x = x + o @ p("attn_output").T
    y = norm(x, p("ffn_norm"))
    gate = y @ p("ffn_gate").T
    x = x + (gate / (1 + np.exp(-gate)) * (y @ p("ffn_up").T)) @ p("ffn_down").T
  head = t.get("output.weight", t["token_embd.weight"])
  return norm(x, t["output_norm.weight"]) @ head.T


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("types", [
    {},
    {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_0, "blk.0.ffn_down.weight": Q.Q4_1,
     "blk.1.attn_k.weight": Q.F16, "token_embd.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.BF16},
], ids=["f32", "quantized"])
def test_gguf_logits_match_a_numpy_forward_over_its_dequantized_tensors(types, bpe, tmp_path):
  model = hf_model("llama", bpe.get_vocab_size(), seed=11)
  path = write_gguf(tmp_path / "m.gguf", model, bpe, types=types)
  loaded = checkpoints.load(path)
  assert loaded.spec.cfg.causal and loaded.spec.cfg.tie_embeddings and not loaded.spec.cfg.scale_tied_logits
  tokens = np.random.default_rng(5).integers(0, bpe.get_vocab_size(), 16)
  ours = np.asarray(loaded.model(jnp.asarray(tokens[None])))[0]
  np.testing.assert_allclose(ours, numpy_reference(path, tokens), rtol=1e-4, atol=1e-4)
  if not types:  # unquantized, the file is the transformers model itself
    np.testing.assert_allclose(ours, torch_logits(model, tokens[None])[0], rtol=1e-4, atol=1e-4)
  assert loaded.chat_template == TEMPLATE


def test_a_cached_gguf_is_read_from_its_index_after_the_first_load(bpe, tmp_path, monkeypatch):
  """A GGUF in the model cache: the first read parses it and writes its index; the next reads
  take the tensors straight from the file (gguf's reader not called) and give the same
  config, tokenizer, weights (quantized ones too) and template. A file changed since
  is parsed again; a file outside the cache gets no index."""
  cache = tmp_path / "cache"
  monkeypatch.setenv("MDLM_JAX_CACHE", str(cache))
  (cache / "models").mkdir(parents=True)
  path = str(write_gguf(cache / "models" / "m.gguf", hf_model("llama", bpe.get_vocab_size(), seed=12), bpe,
                        types={"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_1,
                               "blk.1.attn_k.weight": Q.F16, "blk.0.ffn_gate.weight": Q.BF16}))
  first = gguf_file.read(path)
  assert os.path.isfile(path + gguf_file.INDEX_SUFFIX)

  def no_parse(*args, **kwargs):
    raise AssertionError("parsed again")
  with monkeypatch.context() as m:
    m.setattr(gguf, "GGUFReader", no_parse)
    again = gguf_file.read(path)
    assert gguf_file.chat_template_of(path) == TEMPLATE
  assert again[0].to_json() == first[0].to_json() and again[3:] == first[3:] == (0, TEMPLATE)
  assert sorted(again[2]) == sorted(first[2])
  for name, a in first[2].items():
    np.testing.assert_array_equal(again[2][name], a)
  text = "def f(x):\n  return x  # <|im_start|> 99"
  assert again[1].encode(text) == first[1].encode(text) == bpe.encode(text).ids

  write_gguf(cache / "models" / "m.gguf", hf_model("llama", bpe.get_vocab_size(), seed=13), bpe)
  changed = gguf_file.read(path)
  elsewhere = str(shutil.copy(path, tmp_path / "m.gguf"))  # outside the cache: parsed, no index
  fresh = gguf_file.read(elsewhere)
  assert gguf_file.index_path(elsewhere) is None and not os.path.exists(elsewhere + gguf_file.INDEX_SUFFIX)
  assert any(not np.array_equal(changed[2][k], first[2][k]) for k in first[2])
  for name, a in fresh[2].items():
    np.testing.assert_array_equal(changed[2][name], a)


def test_gguf_tokenizer_is_the_one_its_metadata_was_written_from(bpe, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", hf_model("llama", bpe.get_vocab_size(), seed=2), bpe)
  tok = checkpoints.load(path).tokenizer
  for text in CODE + ["<|im_start|>user\n99 bottles<|im_end|>\n", "  leading spaces\n\n\n  x"]:
    assert tok.encode(text) == bpe.encode(text).ids, text
    assert tok.decode(tok.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.piece(tok.mask_id), tok.adds_bos) == (
      1, 2, 2, "<jupyter_code>", False)


@pytest.mark.slow  # a CLI process; CI converts a folder in process and serves a GGUF model
def test_gguf_samples_and_converts_through_the_cli(bpe, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", hf_model("llama", bpe.get_vocab_size(), seed=4), bpe)
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.sample", f"--checkpoint={path}", "--chat", "--prompt=hi",
                      "--max-new-tokens=6", "--json"], capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout)["forward_passes"] >= 1
  out = tmp_path / "native"
  from mdlm_jax import export
  export.main(["--import", f"--checkpoint={path}", f"--out={out}"])
  a, b = checkpoints.load(path), checkpoints.load(str(out))
  ids = jnp.arange(10)[None]
  np.testing.assert_array_equal(np.asarray(a.model(ids)), np.asarray(b.model(ids)))
  assert b.chat_template == TEMPLATE


def test_gguf_errors_name_the_problem(bpe, tmp_path):
  model = hf_model("llama", bpe.get_vocab_size(), seed=6)
  with pytest.raises(InteropError, match="general.architecture='mamba' is not supported"):
    gguf_file.read(write_gguf(tmp_path / "mamba.gguf", model, bpe, arch="mamba"))
  good = write_gguf(tmp_path / "good.gguf", model, bpe)
  data = open(good, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:len(data) // 2])
  with pytest.raises(InteropError, match="truncated"):
    gguf_file.read(str(cut))
  with pytest.raises(InteropError, match="no such file"):
    gguf_file.read(str(tmp_path / "absent.gguf"))
  # A tensor in a type gguf cannot dequantize (Q8_K: 292 bytes a block of 256).
  w = gguf.GGUFWriter(str(tmp_path / "q8k.gguf"), "llama")
  w.add_tensor("token_embd.weight", np.zeros((1, 292), np.uint8), raw_dtype=Q.Q8_K)
  w.add_block_count(1)
  for key, value in (("embedding_length", 256), ("feed_forward_length", 8), ("attention.head_count", 2),
                     ("attention.layer_norm_rms_epsilon", 1e-5)):
    (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"llama.{key}", value)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(SPECIALS + list("abc"))
  w.add_token_types([3] * len(SPECIALS) + [1] * 3)
  w.add_token_merges([])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(InteropError, match="token_embd.weight is Q8_K, which gguf cannot dequantize"):
    gguf_file.read(str(tmp_path / "q8k.gguf"))
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.sample", f"--checkpoint={cut}", "--prompt=x"],
                     capture_output=True, text=True, check=False)
  assert r.returncode == 2 and "truncated" in r.stderr and "Traceback" not in r.stderr
  out = tmp_path / "never"
  from mdlm_jax import export
  with pytest.raises(InteropError, match="truncated"):
    export.import_folder(export.parse(["--import", f"--checkpoint={cut}", f"--out={out}"]), 2**30)
  assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


@pytest.mark.slow  # a server process; CI runs tests/engine's AR checkpoint test
def test_a_gguf_model_is_served_with_its_chat_template(bpe, tmp_path):
  """serve --checkpoint=FILE.gguf: a chat answer equals the AR generator's greedy continuation of the
  prompt its template renders, streamed or not."""
  import openai
  from tests.server.test_server import start_server
  from mdlm_jax.sampling.ar import ARSampler
  from mdlm_jax.sampling.generate import generator_for
  path = write_gguf(tmp_path / "chat.gguf", hf_model("llama", bpe.get_vocab_size(), seed=8), bpe)
  proc, base = start_server(path, "--model-id=tiny-ar", "--no-warmup", "--slots=2")
  try:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "def f(x):"}]
    r = client.chat.completions.create(model="tiny-ar", messages=messages, max_tokens=12)
    gen = generator_for(checkpoints.load(path))
    prompt = "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n"
    want = gen.generate([prompt], max_new_tokens=12, sampler=ARSampler(12, temperature=0.0), add_bos=False,
                        stop=["<|im_end|>"]).completions[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(gen.encode_prompt(prompt, add_bos=False))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-ar", messages=messages, max_tokens=12, stream=True) if c.choices)
    assert streamed == want.text
  finally:
    proc.kill()
