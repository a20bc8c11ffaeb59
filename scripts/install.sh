#!/usr/bin/env bash
# Fresh machine -> .venv with the CPU build of torch and this package (+ test extras).
# torch is pinned here (not in pyproject) so a fresh machine gets the CPU wheel; the
# package itself accepts any torch>=2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[test]"
