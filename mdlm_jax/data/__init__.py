"""Text to batches: corpora and their train/validation split (the standard
library, files, jsonl, the code corpus built from PyPI wheels), the
tokenizers (sentencepiece, Hugging Face tokenizer.json), the grain pipeline
that packs token rows and shards them over processes, the fill-in-the-middle
transform, and instruction-tuning rows from conversations."""

from mdlm_jax.data import chat, corpus, fim, instructions
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.pipeline import (SPLITS, TokenizerLike, load_all_documents, load_documents, make_eval_batches,
                                    make_train_iterator, split_of, stdlib_files, stdlib_root)
from mdlm_jax.data.tokenizer import MASK_PIECE, Tokenizer, train_tokenizer

__all__ = ["chat", "corpus", "fim", "instructions", "HFTokenizer", "SPLITS", "TokenizerLike", "load_all_documents", "load_documents", "make_eval_batches",
           "make_train_iterator", "split_of", "stdlib_files", "stdlib_root", "MASK_PIECE", "Tokenizer",
           "train_tokenizer"]
