#!/usr/bin/env bash
# The GPU check (issue #32) for a machine with one CUDA GPU and a CUDA build of torch
# (README, "GPUs"): benchmarks/gpu_check.py's checks (real jobs: NCCL at world size 1, every
# outer codec, bf16, overlap, fragments, FSDP2, TP and lossy TP, compile, the asynchronous
# outer level, a kill and heal, a checkpoint and resume) and figures (hier, flat and ddp on
# llama3_debugmodel and llama3_1B). Every failure fails the script.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [gpu_check.py options, e.g. --only tp,heal --no-1b]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
shift || true
exec python benchmarks/gpu_check.py --out "$OUT" "$@"
