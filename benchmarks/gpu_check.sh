#!/usr/bin/env bash
# The GPU check of issue #15, for a machine with one CUDA GPU (and a CUDA build of torch:
# README, "GPUs"). Not run by the test suite; nothing here has been run on a GPU by the
# author of this script (the development machine has none).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        (default runs/gpu_check)
#
# 1. the GPU tests (tests/test_device.py: its cuda tests are skipped without CUDA);
# 2. a demo with every replica group on the one GPU: processes sharing one GPU cannot
#    form an NCCL communicator (NCCL needs one device per rank), so every level uses Gloo
#    on device tensors (train.backends.*=gloo: the link stages them through pinned host
#    buffers, core/links/link.py);
# 3. hier vs flat (torchft DiLoCo) vs ddp on llama3_debugmodel (2 clusters x 2 groups), then
#    on llama3_1B (1.50 B parameters; 2 clusters x 1 group, bf16 weights: with fp32 weights
#    two hier processes would hold ~112 GiB of host memory, planner) when the GPU and the
#    host have the memory: per process the step time, tokens/s and
#    torch.cuda.max_memory_allocated (benchmarks/gpu_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; install a CUDA build (README, GPUs)")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}")
PY

echo "== 1. GPU tests"
python -m pytest -q tests/test_device.py -rs

ONE_GPU="train.device=cuda train.backends.group=gloo train.backends.inner=gloo train.backends.outer=gloo demo.dashboard=false"

echo "== 2/3. llama3_debugmodel, 2 clusters x 2 replica groups on one GPU: hier, flat, ddp"
for mode in hier flat ddp; do
  python -m hier_localsgd demo $ONE_GPU sync.mode=$mode model.name=llama3_debugmodel \
    train.steps=300 train.batch_size=8 train.seq_len=256 run.dir="$OUT/debugmodel_$mode" \
    demo.summary="$OUT/debugmodel_$mode/summary.json"
done
python benchmarks/gpu_report.py "$OUT"/debugmodel_hier "$OUT"/debugmodel_flat "$OUT"/debugmodel_ddp

# ~1.5 B parameters in bf16: weights + grads + AdamW = 12 GB a process on the device before
# activations and sync scratch (planner: hier ~17, flat ~20 GiB); hier's host state ~28 GiB.
FREE_GIB=$(python -c "import torch; f, t = torch.cuda.mem_get_info(); print(int(f / 2**30))")
HOST_GIB=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
if [ "$FREE_GIB" -ge 50 ] && [ "$HOST_GIB" -ge 80 ]; then
  echo "== 3. llama3_1B, 2 clusters x 1 replica group on one GPU (${FREE_GIB} GiB free, host ${HOST_GIB} GiB): hier, flat, ddp"
  for mode in hier flat ddp; do
    python -m hier_localsgd demo $ONE_GPU sync.mode=$mode model.name=llama3_1B topology.replicas_per_cluster=1 \
      train.param_dtype=bf16 train.precision=bf16 train.steps=40 train.batch_size=4 train.seq_len=512 sync.inner.every=5 sync.outer.every=2 \
      sync.flat.every=10 train.eval_batches=2 timeouts.inner_reduce=300 timeouts.outer_reduce=300 timeouts.broadcast=300 \
      timeouts.inner_quorum=300 timeouts.outer_quorum=300 timeouts.local_step=300 timeouts.startup=600 \
      run.dir="$OUT/1B_$mode" demo.summary="$OUT/1B_$mode/summary.json" || echo "gpu_check: llama3_1B $mode failed (see $OUT/1B_$mode/logs)"
  done
  python benchmarks/gpu_report.py "$OUT"/1B_hier "$OUT"/1B_flat "$OUT"/1B_ddp || true
else
  echo "== 3. llama3_1B skipped: ${FREE_GIB} GiB free on the GPU (needs 50), ${HOST_GIB} GiB host (needs 80)"
fi
