"""Reads `pip install --dry-run --report - torch==...` on stdin and prints what a plain
install would do: "cuda" (it would pull a CUDA build of torch: nvidia-* packages, or a
+cu local version), "cpu" (another torch, no CUDA), or "present" (nothing to install).
scripts/install.sh asks this to decide whether torch must come from the CPU index; it
needs only the standard library (it runs before anything else is installed)."""
import json
import sys


def plan(report: dict) -> str:
    found = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report.get("install", [])}
    if any(name.startswith("nvidia-") for name in found) or "+cu" in found.get("torch", ""):
        return "cuda"
    return "cpu" if "torch" in found else "present"


if __name__ == "__main__":
    print(plan(json.load(sys.stdin)))
