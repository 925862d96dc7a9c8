"""The default code model: a ~12M-parameter MDLM on the Python standard library,
sized to train on a 2-core CPU (seq len 256)."""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=6, embed_dim=384, num_heads=6, mlp_dim=1024, mlp="swiglu")
  c.data.update(corpus="stdlib", seq_len=256, batch_size=32, tokenizer_vocab_size=4096)
  c.optim.update(learning_rate=1e-3, warmup_steps=200, ema_decay=0.999)
  c.train.update(num_steps=6000, log_every=20, checkpoint_every=250, eval_every=1000, eval_batches=8)
  return c
