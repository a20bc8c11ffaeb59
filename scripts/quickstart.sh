#!/usr/bin/env bash
# Fresh machine -> virtual environment with the CPU build of torch and this package,
# then the main example: a tiny GPT-2 fine-tuned with ZeRO-3 on 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch is pinned here (not in pyproject) so a fresh machine gets the CPU wheel; the
# package itself accepts any torch>=2.4.
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
.venv/bin/torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py "$@"
