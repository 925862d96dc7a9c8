#!/usr/bin/env bash
# Run one command on every worker of a Cloud TPU VM slice, creating the slice
# first if needed. Each worker runs the same command; MDLM_DISTRIBUTED=auto
# makes mdlm_jax call jax.distributed.initialize(), which finds the other
# workers through the TPU metadata.
#
#   launch/tpu.sh --name my-tpu --zone us-central2-b --accelerator-type v4-64 \
#       --version tpu-ubuntu2204-base -- \
#       python -m mdlm_jax.train --config=configs/llada_8b.py --workdir=/mnt/shared/run
#
# --reuse (the default) creates the slice only when `describe` does not find
# it; --create always creates it (and fails if it exists). --dry-run prints the
# gcloud commands instead of running them. The code and data must already be
# on the workers (e.g. a startup script, or `pip install` as part of COMMAND),
# and the workdir must be a folder every worker shares.
set -euo pipefail

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  echo "usage: $0 --name NAME --zone ZONE [--accelerator-type TYPE] [--version RUNTIME]" \
    "[--project PROJECT] [--reuse|--create] [--spot] [--dry-run] -- COMMAND..." >&2
  exit 2
}

die() { echo "tpu.sh: error: $*" >&2; exit 2; }

# Quote one word for a shell the way a person would: bare when safe, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

quote_all() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(quote "$w")"; done
  printf '%s' "$out"
}

name="" zone="" accel="v4-8" version="tpu-ubuntu2204-base" project="" mode="reuse" spot=0 dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="${2:?--name needs a value}"; shift 2 ;;
    --zone) zone="${2:?--zone needs a value}"; shift 2 ;;
    --accelerator-type) accel="${2:?--accelerator-type needs a value}"; shift 2 ;;
    --version) version="${2:?--version needs a value}"; shift 2 ;;
    --project) project="${2:?--project needs a value}"; shift 2 ;;
    --reuse) mode="reuse"; shift ;;
    --create) mode="create"; shift ;;
    --spot) spot=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) die "unknown flag $1 (the command goes after --)" ;;
  esac
done
[[ -n "$name" ]] || die "--name is required"
[[ -n "$zone" ]] || die "--zone is required"
[[ $# -gt 0 ]] || die "give the command to run on every worker after --"

common=(--zone="$zone")
[[ -n "$project" ]] && common+=(--project="$project")
describe=(gcloud compute tpus tpu-vm describe "$name" "${common[@]}" --format='value(state)')
create=(gcloud compute tpus tpu-vm create "$name" "${common[@]}" --accelerator-type="$accel" --version="$version")
[[ $spot -eq 1 ]] && create+=(--spot)
remote="MDLM_DISTRIBUTED=auto $(quote_all "$@")"
ssh=(gcloud compute tpus tpu-vm ssh "$name" "${common[@]}" --worker=all --command "$remote")

if [[ $dry -eq 1 ]]; then
  if [[ "$mode" == "reuse" ]]; then
    echo "$(quote_all "${describe[@]}")"
    echo "$(quote_all "${create[@]}")  # only if describe finds no such TPU"
  else
    echo "$(quote_all "${create[@]}")"
  fi
  echo "$(quote_all "${ssh[@]}")"
  exit 0
fi

command -v gcloud >/dev/null || die "gcloud is not installed (see https://cloud.google.com/sdk/docs/install)"
if [[ "$mode" == "create" ]] || ! state=$("${describe[@]}" 2>/dev/null); then
  echo "creating TPU $name ($accel, $version) in $zone" >&2
  "${create[@]}"
else
  echo "reusing TPU $name in $zone (state ${state:-unknown})" >&2
fi
exec "${ssh[@]}"
