"""python -m mdlm_jax.tokenizer {train,encode,decode} ...: the sentencepiece
tokenizer's command line (see `mdlm_jax.data.tokenizer`)."""

import sys

from mdlm_jax.data.tokenizer import main

if __name__ == "__main__":
  sys.exit(main())
