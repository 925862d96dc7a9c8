"""Configs read back are complete: merged over base_config(), so no reader restates a default."""

import json
import os
import shutil

from mdlm_jax import checkpoints, config as config_lib
from mdlm_jax.checkpoints import packaged


def test_complete_keeps_what_was_saved_and_fills_the_rest():
  saved = {"objective": "ar", "model": {"num_layers": 3, "from_the_future": 1}, "data": {"seq_len": 64}}
  c = config_lib.complete(saved)
  assert (c.objective, c.model.num_layers, c.model.from_the_future, c.data.seq_len) == ("ar", 3, 1, 64)
  base = config_lib.base_config()
  assert c.model.embed_dim == base.model.embed_dim and c.diffusion.to_dict() == base.diffusion.to_dict()
  assert c.train.to_dict() == base.train.to_dict()
  assert config_lib.complete(base).to_dict() == base.to_dict()


def test_an_export_written_before_a_field_existed_loads_with_its_default(tmp_path):
  """A params-only folder whose config.json predates fields (here whole sections): the loaded
  config has every field, so `loaded.config.diffusion.block_size` and friends just work."""
  folder = str(tmp_path / "old")
  shutil.copytree(packaged.path(packaged.AR), folder)
  path = os.path.join(folder, "config.json")
  with open(path, encoding="utf-8") as f:
    meta = json.load(f)
  for section in ("diffusion", "train", "eval", "sharding"):
    meta["config"].pop(section)
  meta["config"]["data"].pop("chat_template", None)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(meta, f)
  loaded = checkpoints.load(folder)
  base = config_lib.base_config()
  assert loaded.config.diffusion.to_dict() == base.diffusion.to_dict()
  assert loaded.config.train.init_from == "" and loaded.config.data.chat_template == ""
  assert loaded.config.model.num_layers == meta["config"]["model"]["num_layers"]
