#!/usr/bin/env bash
# Fresh machine -> .venv with torch 2.13.0 (the CPU build) and this package (+ test extras).
#
# torch is pinned here, not in pyproject (the package accepts any torch>=2.4). PyPI's
# Linux wheel of torch is the multi-GB CUDA build, so when pip as configured would fetch
# that, torch comes from PyTorch's CPU index instead; where pip already finds a CPU build
# (a local wheel directory or mirror) that one is used, with no download.
#
# For another build, name its index (CUDA 12.8 here; see pytorch.org for the others):
#
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/install.sh
#
# TORCH_INDEX_URL=https://pypi.org/simple takes PyPI's default build. A .venv that has a
# torch 2.13.0 already keeps it: `.venv/bin/pip uninstall torch` first to change builds.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="torch==2.13.0"
CPU_INDEX_URL="https://download.pytorch.org/whl/cpu"
started=$SECONDS

# What a plain `pip install torch==2.13.0` would do here (scripts/torch_install_plan.py:
# "cuda", "cpu" or "present"; nothing when pip cannot tell, and then the install itself
# reports why). A dry run reads package metadata only.
plain_torch_install() {
    .venv/bin/pip install --dry-run --quiet --report - "$TORCH" 2>/dev/null \
        | .venv/bin/python scripts/torch_install_plan.py 2>/dev/null || true
}

if [ -x .venv/bin/python ]; then
    echo "[1/3] using the existing .venv"
else
    echo "[1/3] creating .venv (a few seconds)"
    python3 -m venv .venv
fi

torch_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_index=(--index-url "$TORCH_INDEX_URL")
    echo "[2/3] installing $TORCH from $TORCH_INDEX_URL (~1-3 min)"
else
    case "$(plain_torch_install)" in
        cuda)
            torch_index=(--index-url "$CPU_INDEX_URL")
            echo "[2/3] installing $TORCH, the CPU build from $CPU_INDEX_URL (~1-3 min)" ;;
        present)
            echo "[2/3] $TORCH is already installed" ;;
        cpu)
            echo "[2/3] installing $TORCH, the CPU build pip is configured to find (~1-3 min)" ;;
        *)
            echo "[2/3] installing $TORCH as pip is configured (~1-3 min)" ;;
    esac
fi
# ${a[@]+...}: an empty array under `set -u` in the bash 3.2 of macOS.
.venv/bin/pip install --quiet ${torch_index[@]+"${torch_index[@]}"} "$TORCH"
echo "      torch $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))') ($((SECONDS - started)) s so far)"

echo "[3/3] installing zero_strategy with its test extras: Lightning, Accelerate, transformers, ... (~1-2 min)"
.venv/bin/pip install --quiet -e ".[test]"
echo "done in $((SECONDS - started)) s: .venv is ready (.venv/bin/python, .venv/bin/zero-strategy)"
