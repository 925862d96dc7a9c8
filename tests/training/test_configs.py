"""The configs shipped in configs/: each validates, and the code model's
stages (AR twin -> BD3 -> instruction tuning) can start from one another."""

import glob
import os

import pytest

from mdlm_jax.config import validate
from tests.conftest import REPO, load_config


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))),
                         ids=lambda p: os.path.basename(p))
def test_every_config_validates(path):
  validate(load_config(os.path.splitext(os.path.basename(path))[0]))


def test_the_code_model_stages_share_one_network():
  ar, bd3, sft = (load_config(n) for n in ("ar_pycode", "bd3_pycode", "sft_pycode"))
  for key in ("num_layers", "embed_dim", "num_heads", "mlp_dim", "mlp", "tie_embeddings"):
    assert ar.model[key] == bd3.model[key] == sft.model[key], key
  assert ar.objective == "ar" and bd3.diffusion.block_size == sft.diffusion.block_size > 0
  assert bd3.model.shift_logits and sft.model.shift_logits
  assert min(c.data.seq_len for c in (ar, bd3, sft)) >= 1024
  # The tuned model keeps infilling in the engine's format and speaks ChatML.
  assert sft.data.kind == "chat" and sft.data.chat_template == "chatml" and sft.data.fim_rate > 0
  assert sft.data.tokenizer == bd3.data.tokenizer == ar.data.tokenizer
