"""A tiny byte-level BPE (SmolLM2's kind of vocabulary), trained in milliseconds, for tests."""


def byte_level_bpe_json(texts, vocab_size: int, specials) -> str:
  """tokenizer.json of a byte-level BPE trained on `texts`, `specials` first."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tk.train_from_iterator(texts, trainer)
  return tk.to_str()
