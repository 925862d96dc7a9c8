"""Tiny MDLM for tests and smoke runs: trains for a few seconds on a CPU."""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=2, embed_dim=64, num_heads=4, mlp_dim=128, cond_dim=32)
  c.data.update(seq_len=64, batch_size=8, tokenizer_vocab_size=512, tokenizer_max_chars=1_000_000)
  c.optim.update(learning_rate=3e-3, warmup_steps=10, ema_decay=0.99)
  c.train.update(num_steps=50, log_every=10, checkpoint_every=25, eval_batches=2)
  c.eval.update(num_batches=2, time_samples=2)
  return c
