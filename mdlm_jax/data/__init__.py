"""Text to batches: corpora and their train/validation split, the tokenizers
(sentencepiece, Hugging Face tokenizer.json) and the grain pipeline that
packs token rows and shards them over processes."""

from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.pipeline import (SPLITS, TokenizerLike, load_all_documents, load_documents, make_eval_batches,
                                    make_train_iterator, split_of, stdlib_files, stdlib_root)
from mdlm_jax.data.tokenizer import MASK_PIECE, Tokenizer, train_tokenizer

__all__ = ["HFTokenizer", "SPLITS", "TokenizerLike", "load_all_documents", "load_documents", "make_eval_batches",
           "make_train_iterator", "split_of", "stdlib_files", "stdlib_root", "MASK_PIECE", "Tokenizer",
           "train_tokenizer"]
