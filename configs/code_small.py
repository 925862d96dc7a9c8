"""The default code model: a ~5M-parameter MDLM on the Python standard library,
sized so that it and its AR twin train in about an hour on a 2-core CPU.

L=384 covers the sampling benchmark's 64-token prompt plus 256 new tokens, so
no position at sampling time lies beyond what the model saw in training. The
head is untied: with a tied head the model first has to unlearn predicting its
own input token, which costs the first hundred steps of a short run."""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=4, embed_dim=256, num_heads=4, mlp_dim=704, mlp="swiglu",
                 tie_embeddings=False)
  c.data.update(corpus="stdlib", seq_len=384, batch_size=12, tokenizer_vocab_size=4096)
  c.optim.update(learning_rate=2e-3, warmup_steps=30, ema_decay=0.99)
  c.train.update(num_steps=400, log_every=10, checkpoint_every=50, eval_every=200, eval_batches=8)
  return c
