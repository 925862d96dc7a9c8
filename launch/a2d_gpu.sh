#!/usr/bin/env bash
# The SmolLM2 adaptation on one GPU inside a fixed time budget (a leased machine):
# stage A, block diffusion on the standard library's source, then stage B, chat on the
# base's own answers (configs/a2d_smollm2_chat.py), each stopped by SIGTERM at its share
# of the budget (a stopped run saves a checkpoint), then the adapters of stage B's
# checkpoint with the lowest held-out NELBO exported to OUT (stage A's last if B left none).
#
#   launch/a2d_gpu.sh SECONDS OUT [INIT]
#
# It ends within SECONDS: give a leased machine's call limit less a margin for the setup.
#
# INIT: what stage A starts from (default: the packaged adapters). Needs the base in the
# model cache ($MDLM_JAX_CACHE; `python -m mdlm_jax.fetch smollm2-135m-instruct`) and the
# chat folder (exports/a2d_chat_data/README.md rebuilds data/a2d_chat4).
# Workdirs go under $A2D_RUNS (default /tmp/a2d_runs); $A2D_FLAGS (e.g.
# "--config.model.dtype=bfloat16") is added to both stages' flags; where stage A fails
# before its first checkpoint, it runs once more with $A2D_FALLBACK_FLAGS in their place
# (a faster setting tried first, the known one after). $A2D_CHAT names the chat folder
# (default data/a2d_chat4), $A2D_SHARE_A stage A's percent of the time (default 45) and
# $A2D_STEPS_A its steps (default 800; the learning rate's cosine spans them).
set -u -o pipefail
if [ $# -lt 2 ]; then
  echo "usage: launch/a2d_gpu.sh SECONDS OUT [INIT]" >&2
  exit 2
fi
budget=$1 out=$2 init=${3:-mdlm_jax/assets/a2d_smollm2}
if ! [[ $budget =~ ^[0-9]+$ ]] || [ "$budget" -le 120 ]; then
  echo "SECONDS must be a whole number above 120 (the exports and each run's start take about 110), got '$budget'" >&2
  exit 2
fi
runs=${A2D_RUNS:-/tmp/a2d_runs}
export PYTHONUNBUFFERED=1  # progress lines reach the logs as they happen
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
# until MARK GRACE CMD...: CMD, sent SIGTERM at MARK seconds into the budget and killed GRACE
# seconds later; where the mark has passed it does not start (`timeout 0` would never stop it)
# and returns 124, as a command stopped in time does.
until_mark() {
  local left=$(($1 - $(elapsed))) grace=$2
  shift 2
  if [ "$left" -le 0 ]; then
    echo "no time left in the budget for: $*" >&2
    return 124
  fi
  timeout -s TERM -k "$grace" "$left" "$@"
}
mkdir -p "$out" "$runs"
chat=${A2D_CHAT:-data/a2d_chat4}
[ -f "$chat/train.jsonl" ] || { echo "$chat/train.jsonl not found" >&2; exit 2; }

# About 110 s go to the two exports and each run's start beyond its steps; stage A gets
# A2D_SHARE_A percent of the rest.
stage_a_end=$(((budget - 110) * ${A2D_SHARE_A:-45} / 100))
stage_a() {  # FLAGS: stage A until its share of the budget is spent
  until_mark "$stage_a_end" 25 python -m mdlm_jax.train --config=configs/a2d_smollm2.py \
    --workdir="$runs/a" --config.diffusion.block_size=4 --config.train.init_from="$init" \
    --config.data.seq_len=512 --config.data.batch_size=32 --config.data.shuffle_seed=5 \
    --config.optim.learning_rate=5e-4 --config.optim.warmup_steps=20 --config.train.num_steps=${A2D_STEPS_A:-800} \
    --config.train.log_every=10 --config.train.checkpoint_every=50 --config.train.eval_every=0 \
    --config.train.eval_batches=4 $1 2>&1 | tee -a "$out/log_a.txt"
}
stage_a "${A2D_FLAGS:-}"
code=$?
if [ $code -ne 0 ] && [ $code -ne 124 ] && [ ! -d "$runs/a/checkpoints" ] && [ -n "${A2D_FALLBACK_FLAGS+set}" ]; then
  echo "stage A failed (exit $code) before its first checkpoint; again with A2D_FALLBACK_FLAGS" | tee -a "$out/log_a.txt"
  A2D_FLAGS=${A2D_FALLBACK_FLAGS}; rm -rf "$runs/a"
  stage_a "$A2D_FLAGS"
fi

from="$runs/a"
[ -d "$runs/a/checkpoints" ] || from="$init"
# Stage B stops early enough that its SIGTERM grace (25 s) and the export (up to 90 s:
# the base and the checkpoint loaded again) still end inside the budget.
until_mark $((budget - 115)) 25 python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py \
  --workdir="$runs/b" --config.train.init_from="$from" --config.data.corpus="$chat" \
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
until_mark $((budget - 5)) 5 python -m mdlm_jax.export --checkpoint="$best" --out="$out/adapters" --adapters-only \
  --overwrite
