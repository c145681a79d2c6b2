#!/usr/bin/env bash
# Set up .venv for lightning-dcp on a fresh machine: Python >= 3.10, no GPU needed.
#
# - An existing torch (e.g. a CUDA build on a GPU box) is kept: the venv sees system packages.
# - Without torch, the pinned torch==2.13.0 is installed; on this project's CPU machines pip
#   takes the CPU wheel from local disk, so no multi-GB CUDA download happens.
# - Then the package itself, editable, with the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, lightning, deepspeed, lightning_dcp; print(f'lightning-dcp {lightning_dcp.__version__}: torch {torch.__version__}, lightning {lightning.__version__}, deepspeed {deepspeed.__version__}')" 2>&1 | grep -v -i "accelerator\|warn" || true
