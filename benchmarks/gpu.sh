#!/usr/bin/env bash
# The GPU measurements of issue 22, item 6, in one short call on a machine with a CUDA GPU:
#   OUT=/some/folder bash benchmarks/gpu.sh
# Needs a Python with a CUDA build of torch; fedtailor's other dependencies are installed from .whl/ when it holds
# wheels (a machine without a network; the code is read from src/);
# runs the pFL round benchmark (FedLAG setup,
# DNN and CNN, both alphas) and the compact-adaptation round benchmark on the GPU, each against its baseline in
# the same run; the tables go to $OUT/RESULTS-gpu.md (and are appended to benchmarks/RESULTS.md on that machine).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then  # dependencies carried as wheels to a machine without a network
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
before=$(wc -l < benchmarks/RESULTS.md)
$PY -c "import torch, fedtailor; print('torch', torch.__version__, 'fedtailor from', fedtailor.__file__)"
timeout 240 $PY benchmarks/bench_pfl_round.py --device cuda --threads 4 --repeat 1 --no-vmap --workers 0 2>&1 \
  | tee "$OUT/pfl_round.log" || echo "bench_pfl_round.py stopped (exit $?)" | tee -a "$OUT/pfl_round.log"
timeout 150 $PY benchmarks/bench_compact_round.py --device cuda --threads 4 --repeat 3 \
  --transforms layer-kronecker,kronecker,blocked-dct 2>&1 | tee "$OUT/compact_round.log" \
  || echo "bench_compact_round.py stopped (exit $?)" | tee -a "$OUT/compact_round.log"
tail -n +"$((before + 1))" benchmarks/RESULTS.md > "$OUT/RESULTS-gpu.md"
