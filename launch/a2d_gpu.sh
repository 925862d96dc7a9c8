#!/usr/bin/env bash
# The SmolLM2 adaptation on one GPU inside a fixed time budget (a leased machine):
# stage A, block diffusion on the standard library's source, then stage B, chat on the
# base's own answers (configs/a2d_smollm2_chat.py), each stopped by SIGTERM at its share
# of the budget (a stopped run saves a checkpoint), then the adapters of stage B's
# checkpoint with the lowest held-out NELBO exported to OUT (stage A's last if B left none).
#
#   launch/a2d_gpu.sh SECONDS OUT [INIT]
#
# INIT: what stage A starts from (default: the packaged adapters). Needs the base in the
# model cache ($MDLM_JAX_CACHE; `python -m mdlm_jax.fetch smollm2-135m-instruct`) and the
# chat folder at data/a2d_chat4 (exports/a2d_chat_data/README.md rebuilds it).
# Workdirs go under $A2D_RUNS (default /tmp/a2d_runs); $A2D_FLAGS (e.g.
# "--config.data.batch_size=2") is added to both stages' flags.
set -u -o pipefail
if [ $# -lt 2 ]; then
  echo "usage: launch/a2d_gpu.sh SECONDS OUT [INIT]" >&2
  exit 2
fi
budget=$1 out=$2 init=${3:-mdlm_jax/assets/a2d_smollm2}
runs=${A2D_RUNS:-/tmp/a2d_runs}
export PYTHONUNBUFFERED=1  # progress lines reach the logs as they happen
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
mkdir -p "$out" "$runs"
[ -f data/a2d_chat4/train.jsonl ] || { echo "data/a2d_chat4/train.jsonl not found" >&2; exit 2; }

# About 110 s go to the two exports and each run's start beyond its steps; stage A gets
# 45% of the rest.
stage_a=$(((budget - 110) * 45 / 100))
timeout -s TERM -k 25 "$stage_a" python -m mdlm_jax.train --config=configs/a2d_smollm2.py --workdir="$runs/a" \
  --config.diffusion.block_size=4 --config.train.init_from="$init" \
  --config.data.seq_len=512 --config.data.batch_size=32 --config.data.shuffle_seed=5 \
  --config.optim.learning_rate=5e-4 --config.optim.warmup_steps=20 --config.train.num_steps=800 \
  --config.train.log_every=10 --config.train.checkpoint_every=50 --config.train.eval_every=0 \
  --config.train.eval_batches=4 ${A2D_FLAGS:-} 2>&1 | tee "$out/log_a.txt"

from="$runs/a"
[ -d "$runs/a/checkpoints" ] || from="$init"
stage_b=$((budget - 45 - $(elapsed)))
timeout -s TERM -k 25 "$stage_b" python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py \
  --workdir="$runs/b" --config.train.init_from="$from" --config.data.corpus=data/a2d_chat4 \
  --config.data.batch_size=32 --config.data.shuffle_seed=5 --config.optim.learning_rate=3e-4 \
  --config.train.num_steps=800 --config.train.keep_checkpoints=12 --config.train.log_every=10 \
  --config.train.checkpoint_every=100 --config.train.eval_every=100 --config.train.eval_batches=2 \
  ${A2D_FLAGS:-} 2>&1 | tee "$out/log_b.txt"

best=$(python - "$runs" <<'PY'
import json, os, sys
runs = sys.argv[1]
best = None
metrics = os.path.join(runs, "b", "metrics.jsonl")
if os.path.isfile(metrics):
  for line in open(metrics):
    r = json.loads(line)
    step = os.path.join(runs, "b", "checkpoints", str(r["step"]))
    if r.get("kind") == "eval" and os.path.isdir(step) and (best is None or r["nats_per_token"] < best[0]):
      best = (r["nats_per_token"], step)
last = os.path.join(runs, "b") if os.path.isdir(os.path.join(runs, "b", "checkpoints")) else os.path.join(runs, "a")
print(best[1] if best else last)
PY
)
echo "exporting $best after $(elapsed) s"
python -m mdlm_jax.export --checkpoint="$best" --out="$out/adapters" --adapters-only --overwrite
