"""The A2D recipe at the size of the packaged code twin, where a choice costs
minutes rather than hours: the packaged 5.3M AR model (`ar_code_small`)
adapted to blocks of 4 on its own corpus with the same layout as
`a2d_smollm2.py` (causal clean stream, shifted head, rank-16 adapters on the
noisy rows, the base frozen, half of each token's loss distilled from it).

`python -m mdlm_jax.bench ablate` trains one copy of it per choice of the
recipe for the same tokens and sets their bounds and tokens a pass side by
side (docs/training.md, "Ablation"); on its own:

  python -m mdlm_jax.train --config=configs/a2d_code_small.py --workdir=runs/a2d_code_small
"""

import os

from mdlm_jax.checkpoints import packaged
from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py"))
  c.objective = "mdlm"
  c.model.update(causal=False, shift_logits=True, clean_causal=True, lora_rank=16, lora_alpha=32.0)
  c.train.init_from = packaged.path(packaged.AR)
  c.train.trainable = "adapters"
  c.diffusion.block_size = 4
  c.diffusion.update(train_t_min=0.3, train_t_max=0.8, distill_weight=0.5)
  c.optim.update(learning_rate=1e-3, warmup_steps=20, weight_decay=0.0, ema_decay=0.99)
  c.train.update(num_steps=300, eval_every=100, checkpoint_every=100)
  return c
