"""A GGUF file's vocabulary as a Hugging Face `tokenizers` byte-level BPE.

A GGUF carries no tokenizer.json: its `tokenizer.ggml.*` metadata holds the
tokens, their types and the merges, and `tokenizer.ggml.pre` names the
pre-tokenizer llama.cpp splits text with before the merges. Each name maps to
llama.cpp's split expressions (llama-vocab.cpp), applied in order, then
byte-level BPE; control tokens become special tokens, so a chat marker in the
text is one id, as in llama.cpp and in the model's own tokenizer.json.
Byte-level BPE is lossless: any text, code and unicode included, decodes back
to itself.
"""

from __future__ import annotations

import json
from typing import Sequence

from mdlm_jax.data.hf_tokenizer import _tokenizers

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the split expressions, in llama.cpp's order.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2,) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    **{name: (r"\p{N}", _GPT2) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{name: (_LLAMA3,) for name in ("llama-bpe", "llama3", "smaug-bpe", "dbrx", "pixtral")},
    **{name: (_QWEN2,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def tokenizer_json(tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pre: str,
                   source: str) -> str:
  """tokenizer.json text of a `gpt2`-model GGUF vocabulary; ValueError naming what is unsupported."""
  tk = _tokenizers()
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported"
                     f" (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
  if len(token_types) != len(tokens):
    raise ValueError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError(f"{source}: tokenizer.ggml.tokens has duplicate tokens")
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"{source}: merge {m!r} is not two tokens separated by a space")
    pairs.append((a, b))
  t = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  t.pre_tokenizer = tk.pre_tokenizers.Sequence(
      [tk.pre_tokenizers.Split(tk.Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
      + [tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  t.decoder = tk.decoders.ByteLevel()
  for kind, add in ((CONTROL, t.add_special_tokens), (USER_DEFINED, t.add_tokens)):
    add([tk.AddedToken(tokens[i], special=kind == CONTROL, normalized=False)
         for i, k in enumerate(token_types) if k == kind])
  text = t.to_str()
  json.loads(text)  # tokenizers writes valid JSON; a failure here is a bug, not bad input
  return text
