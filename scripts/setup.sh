#!/usr/bin/env bash
# Create .venv and install replaylm into it (CPU machine).
#   scripts/setup.sh          engine only
#   scripts/setup.sh --test   engine + server + bench plots + test tools (pytest, pytest-xdist,
#                             hypothesis, ruff, openai client, matplotlib, triton interpreter)
# torch is pinned to 2.13.0 first: on the CPU machines here that is a local CPU build, while an
# unpinned torch would pull a multi-GB CUDA build. transformers is pinned to the GPU machine's
# 5.17 so the reference the tests compare against is the same everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test,server,bench]"; pip install -q "triton==3.6.0"; fi
pip install -q -e ".${extras}" "transformers==5.17.*"
