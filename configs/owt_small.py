"""MDLM's OpenWebText recipe (Sahoo et al. 2024): 12 x 768, 12 heads, L=1024,
global batch 512, lr 3e-4 with 2500 warmup steps, EMA 0.9999, adaLN time
conditioning off (MDLM's best OWT model is time-independent).

Point data.corpus at the OpenWebText text (a folder, glob or jsonl) and
data.tokenizer at a sentencepiece model (MDLM uses the GPT-2 BPE, vocab 50257).

Sharding variants (the model is small: plain data parallelism is the default):
  data parallel over every device (the default):
    --config.mesh.data=-1
  FSDP, to shard the parameters, EMA and Adam state as well:
    --config.mesh.data=1 --config.mesh.fsdp=-1 --config.sharding.rules=fsdp
  FSDP x 2-way tensor parallelism:
    --config.mesh.data=1 --config.mesh.fsdp=-1 --config.mesh.tensor=2 --config.sharding.rules=fsdp_tp
"""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(num_layers=12, embed_dim=768, num_heads=12, mlp_dim=3072, mlp="gelu", dtype="bfloat16")
  c.data.update(corpus="/data/openwebtext/*.txt", seq_len=1024, batch_size=512, tokenizer_vocab_size=50257,
                tokenizer_max_chars=200_000_000)
  c.optim.update(learning_rate=3e-4, warmup_steps=2500, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0,
                 ema_decay=0.9999, min_lr_ratio=1.0)
  c.train.update(num_steps=1_000_000, log_every=100, checkpoint_every=5000, eval_every=10000, eval_batches=64)
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  return c
