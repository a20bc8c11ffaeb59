#!/usr/bin/env bash
# One-shot GPU check (issue #17), under 8 minutes on one H200: tests/core/test_gpu.py (-m gpu),
# then benchmarks/gpu_check.py (step time vs plain PyTorch, MFU, peak memory per stage vs
# the formula, activation-checkpoint offload, optimizer offload of a ~7B model). Nothing is
# downloaded: every model is built from a config. The report goes to $OUT (default
# ./gpu_check_out) as gpu_check.md + gpu_check.json and is printed.
#
#   bash benchmarks/gpu_check.sh                    # on the GPU machine
#   bash benchmarks/gpu_check.sh --device cpu --tiny  # rehearsal of the same code path on CPU
#
# Python: $GPU_CHECK_PYTHON if set, else the first of .venv/bin/python, python, python3 whose
# torch sees a CUDA device (any that imports torch with --device cpu). Extra arguments go to
# gpu_check.py (e.g. --parts stages,offload, --peak-tflops 835 on an H200 NVL).
set -u
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT_DIR"
export OUT="$OUT_DIR"
# The package from this working tree, installed or not.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
TOTAL_S=470   # the whole script, tests included (7 min 50 s)
TESTS_S=120
START=$(date +%s)

want_cuda=1
prev=""
for a in "$@"; do
  { [ "$a" = "--device=cpu" ] || { [ "$prev" = "--device" ] && [ "$a" = "cpu" ]; }; } && want_cuda=0
  prev="$a"
done

probe='import torch, sys; sys.exit(0 if (torch.cuda.is_available() or not int(sys.argv[1])) else 3)'
PY=""
for cand in ${GPU_CHECK_PYTHON:-} .venv/bin/python python python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "$probe" "$want_cuda" >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no python whose torch sees a CUDA device (tried ${GPU_CHECK_PYTHON:-} .venv/bin/python python python3)" >&2
  for cand in .venv/bin/python python python3; do
    command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | sed "s|^|  $cand: |"
  done
  exit 2
fi
echo "gpu_check: using $(command -v "$PY")"
"$PY" - <<'EOF'
import importlib, platform, torch
print(f"python {platform.python_version()}; torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    v = torch.cuda.nccl.version()
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}; "
          f"NCCL {'.'.join(map(str, v)) if isinstance(v, tuple) else v}")
for mod in ("transformers", "yaml", "safetensors", "pytest", "zero_strategy"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '?')} ({m.__file__})")
    except Exception as exc:
        print(f"{mod}: MISSING ({type(exc).__name__}: {exc})")
EOF

# 1. tests/core/test_gpu.py: the 2-GPU tests skip on one device; the activation-offload test runs.
TESTS_LOG="$OUT_DIR/test_gpu.log"
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "gpu_check: pytest -m gpu tests/core/test_gpu.py (up to ${TESTS_S} s)"
  timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/core/test_gpu.py >"$TESTS_LOG" 2>&1
  TESTS_RC=$?
  [ "$TESTS_RC" = 124 ] && echo "(stopped at the ${TESTS_S} s limit)" >>"$TESTS_LOG"
  tail -n 5 "$TESTS_LOG"
else
  echo "pytest is not installed for $PY: tests/core/test_gpu.py not run" >"$TESTS_LOG"
  TESTS_RC="not run"
fi

# 2. The benchmark, with what is left of the budget (each part has its own limit inside).
LEFT=$(( TOTAL_S - ($(date +%s) - START) ))
echo "gpu_check: benchmarks/gpu_check.py (budget ${LEFT} s)"
timeout -k 10 $(( LEFT + 5 )) "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" --budget "$(( LEFT - 10 ))" \
  --tests-log "$TESTS_LOG" --tests-rc "$TESTS_RC" "$@"
RC=$?
echo "gpu_check: finished in $(( $(date +%s) - START )) s (status $RC); report in $OUT_DIR/gpu_check.md"
exit $RC
