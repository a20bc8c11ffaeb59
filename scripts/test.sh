#!/usr/bin/env bash
# Run the whole test suite (installs first if the environment is missing).
# Quick local loop: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".[test]"
fi
exec .venv/bin/python -m pytest -q "$@"
