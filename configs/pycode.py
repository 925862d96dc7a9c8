"""The code model of the packaged default: pretrained on the Python corpus
built from pinned PyPI wheels, with fill-in-the-middle, at a 1024-token context.

Its data come from two commands (see docs/packaged-models.md):

  python -m mdlm_jax.corpus build --out data/pycode
  python -m mdlm_jax.tokenizer train --corpus=data/pycode --out=data/pycode_tok8k.model \\
      --vocab-size=8192 --chat-fim-pieces --max-chars=50000000

This file is the MDLM form; `ar_pycode.py` is the AR twin trained first and
`bd3_pycode.py` the block-diffusion model adapted from it.

The network (9.0M parameters) is sized by measurement on a 2-core CPU. The AR
twin trains at about 1,190 tokens/s at 35% MFU, against 870 tokens/s for a
12.7M-parameter variant (d=320). At a budget of tens of millions of tokens, the
smaller model gets the lower loss per FLOP. The AR twin and the BD3 model
together take 36 MB in bfloat16, under the 60 MB limit. The AR run is 4,000
steps of 8 x 1,024 tokens (33M tokens, about 8 hours), spread over several
sessions; the same command resumes it.
"""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=6, embed_dim=256, num_heads=4, mlp_dim=704, mlp="swiglu", tie_embeddings=False)
  c.data.update(corpus="data/pycode", tokenizer="data/pycode_tok8k.model", seq_len=1024, batch_size=8,
                validation_fraction=0.01, fim_rate=0.5, fim_spm_rate=0.5)
  c.optim.update(learning_rate=2e-3, warmup_steps=200, ema_decay=0.999)
  c.train.update(num_steps=4000, log_every=10, checkpoint_every=100, eval_every=500, eval_batches=8)
  return c
