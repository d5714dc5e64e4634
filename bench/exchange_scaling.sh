#!/usr/bin/env bash
# The training example in the PULSE authors' configuration (bf16 local weights, the authors' Δ)
# at R = 2, 4, 8 and 16 workers under mpirun, each exchange kind in turn (allgather, reduction,
# auto): every window's union ratio, the kind that ran and the bytes a worker received, one JSON
# record per (R, kind, window) on stdout. docs/benchmarks.md, "Exchange kinds".
#
#   bench/exchange_scaling.sh [RANKS...] > bench/results/exchange-scaling-example.jsonl
#   python3 bench/exchange_report.py bench/results/exchange-scaling-example.jsonl
#
# Needs the built tree (./scripts/build) and mpirun. WINDOWS (default 2) windows per run.
# LOCAL_DTYPE=fp32 runs with fp32 local weights instead (every record names its local_dtype).
# ENCODING=context codes the messages with the context encoding instead of pulse (every record
# names its encoding; the bits are the same either way).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=("$@")
((${#ranks[@]} > 0)) || ranks=(2 4 8 16)
windows=${WINDOWS:-2}
local_dtype=${LOCAL_DTYPE:-bf16}
encoding=${ENCODING:-pulse}
case "$local_dtype" in
  bf16) dtype_args=(--local-dtype bf16 --bf16-delta authors) ;;
  fp32) dtype_args=(--local-dtype fp32) ;;
  *) echo "exchange_scaling.sh: LOCAL_DTYPE must be bf16 or fp32, not '$local_dtype'" >&2; exit 2 ;;
esac
case "$encoding" in
  pulse | context) ;;
  *) echo "exchange_scaling.sh: ENCODING must be pulse or context, not '$encoding'" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

export PULSELOCO_LOG_LEVEL=warn
export PULSELOCO_SECRET="${PULSELOCO_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
mpirun_args=(--oversubscribe --bind-to none -x PULSELOCO_LOG_LEVEL -x PULSELOCO_SECRET)
if [[ $(id -u) -eq 0 ]]; then mpirun_args+=(--allow-run-as-root); fi

build/bin/pulseloco_train --pretrain-only --threads "$(nproc)" >&2
for r in "${ranks[@]}"; do
  for kind in allgather reduction auto; do
    json="$work/r$r-$kind.json"
    mpirun "${mpirun_args[@]}" -np "$r" build/bin/pulseloco_train --mode pulse \
      "${dtype_args[@]}" --windows "$windows" --threads 1 \
      --exchange "$kind" --encoding "$encoding" --json "$json" >&2
    python3 - "$json" "$r" "$kind" "$local_dtype" "$encoding" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
for w in run["windows"]:
    print(json.dumps({"benchmark": "exchange_scaling", "ranks": int(sys.argv[2]),
                      "option": sys.argv[3], "local_dtype": sys.argv[4], "encoding": sys.argv[5],
                      "window": w["window"], "exchange": w["exchange"],
                      "union_ratio": w["union_ratio"], "density": w["density"],
                      "payload_bytes": w["payload_bytes"],
                      "received_bytes": w["received_bytes"],
                      "wire_bytes_received": w["wire_bytes_received"],
                      "digest": w["digests"][0] if w["digests"] else None}))
PY
  done
done
