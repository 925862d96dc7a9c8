"""python -m mdlm_jax.corpus build --out DIR: the Python code corpus from
pinned PyPI wheels (see `mdlm_jax.data.corpus`)."""

import sys

from mdlm_jax.data.corpus import main

if __name__ == "__main__":
  sys.exit(main())
