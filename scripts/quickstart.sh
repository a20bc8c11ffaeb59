#!/usr/bin/env bash
# Install (scripts/install.sh), then the main example: a tiny GPT-2 fine-tuned with
# ZeRO-3 on 2 CPU processes. Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
echo "example: fine-tuning a tiny GPT-2 with ZeRO-3 on 2 CPU processes (~30 s)"
.venv/bin/torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py "$@"
