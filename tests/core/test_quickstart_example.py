"""The quick start's example (examples/finetune_tiny_gpt2.py) explains its own numbers:
the stage-3 volume it predicts from the partition plan is the volume the engine counted,
and its memory table is in GiB."""
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_tiny_gpt2.py"


def _run(*args) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_stage3_explanation_predicts_the_counted_volume():
    out = _run()
    counted = int(re.search(r"paper_volume\s+([\d,]+) = ", out).group(1).replace(",", ""))
    # "Expected: 3 x P - R + 2 x W = V": the formula from the plan, and its arithmetic.
    p, r, w, v = (int(x.replace(",", "")) for x in re.search(
        r"Expected: 3 x ([\d,]+) - ([\d,]+) \+ 2 x ([\d,]+) = ([\d,]+)", out).groups())
    assert 3 * p - r + 2 * w == v == counted
    assert "min_gather_numel" in out and "--min-gather-numel 0" in out  # how to see nearer 3 Psi
    memory = out.split("memory on rank 0")[1].split("communication")[0]
    assert "GiB" in memory and not re.search(r"\bMi?B\b", memory)
