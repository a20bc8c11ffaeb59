#!/usr/bin/env bash
# Run the whole test suite (installing first when .venv is missing).
# Quick local loop: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
