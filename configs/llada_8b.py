"""LLaDA-8B shape (Nie et al. 2025) for TPU pods and GPU clusters: 32 layers,
4096 wide, 32 heads, SwiGLU MLP 12288, vocab 126464, untied output head,
rope theta 500000, bf16 compute, parameters sharded FSDP over the mesh.

Point data.tokenizer at the tokenizer model and data.corpus at the data.

Sharding variants (check one with `python -m mdlm_jax.plan` before asking for it):
  FSDP over every device (the default):
    --config.mesh.fsdp=-1 --config.sharding.rules=fsdp
  FSDP x 8-way tensor parallelism (one node of 8 GPUs, or 8 TPU chips, per tensor group):
    --config.mesh.fsdp=-1 --config.mesh.tensor=8 --config.sharding.rules=fsdp_tp
  several FSDP groups side by side (e.g. one per slice), data parallel between them:
    --config.mesh.data=4 --config.mesh.fsdp=-1
The global batch of 1280 x 4096 tokens needs gradient accumulation below a few
hundred devices (`python -m mdlm_jax.plan --config=configs/llada_8b.py
--mesh=fsdp=64 --grad-accum=10 --device-memory=80GiB`).
"""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=32, embed_dim=4096, num_heads=32, mlp_dim=12288, mlp="swiglu",
                 tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5, dtype="bfloat16", remat=True,
                 vocab_size=126464)
  c.data.update(corpus="/data/pretrain/*.jsonl", seq_len=4096, batch_size=1280, tokenizer_vocab_size=126464)
  c.optim.update(learning_rate=4e-4, warmup_steps=2000, weight_decay=0.1, b1=0.9, b2=0.95, ema_decay=0.0)
  c.train.update(num_steps=500_000, log_every=10, checkpoint_every=1000, eval_every=5000, eval_batches=16)
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.sharding.rules = "fsdp"
  return c
