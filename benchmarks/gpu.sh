#!/usr/bin/env bash
# The GPU measurements of issue 22, item 6, in one short call on a machine with a CUDA GPU:
#   OUT=/some/folder bash benchmarks/gpu.sh
# Needs a Python with a CUDA build of torch and fedtailor's dependencies (no network: the code is read from src/);
# runs the pFL round benchmark (FedLAG setup,
# DNN and CNN, both alphas) and the compact-adaptation round benchmark on the GPU, each against its baseline in
# the same run; the tables go to $OUT/RESULTS-gpu.md (and are appended to benchmarks/RESULTS.md on that machine).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
before=$(wc -l < benchmarks/RESULTS.md)
timeout 300 $PY benchmarks/bench_pfl_round.py --device cuda --threads 4 --repeat 3 2>&1 | tee "$OUT/pfl_round.log"
timeout 240 $PY benchmarks/bench_compact_round.py --device cuda --threads 4 --repeat 3 \
  --transforms layer-kronecker,kronecker,blocked-dct 2>&1 | tee "$OUT/compact_round.log"
tail -n +"$((before + 1))" benchmarks/RESULTS.md > "$OUT/RESULTS-gpu.md"
