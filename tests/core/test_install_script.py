"""scripts/install.sh takes torch from PyTorch's CPU index exactly when a plain install
would fetch a CUDA build: scripts/torch_install_plan.py reads pip's dry-run report, here
both hand-written reports and the report pip really writes for wheels made in the test."""
import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "scripts" / "torch_install_plan.py"


def _plan_module():
    spec = importlib.util.spec_from_file_location("torch_install_plan", PLAN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(*installs):
    return {"install": [{"metadata": {"name": name, "version": version}} for name, version in installs]}


@pytest.mark.parametrize("installs, want", [
    ([("torch", "2.13.0"), ("nvidia-cublas-cu12", "12.8.4.1"), ("sympy", "1.14.0")], "cuda"),  # PyPI on Linux
    ([("torch", "2.13.0+cu128")], "cuda"),  # a mirror's CUDA build without separate nvidia packages
    ([("torch", "2.13.0+cpu"), ("sympy", "1.14.0")], "cpu"),  # a local CPU wheel, as on the CI machine
    ([("torch", "2.13.0")], "cpu"),  # e.g. macOS, where PyPI's torch has no CUDA
    ([], "present"),  # already installed
])
def test_plan_from_a_report(installs, want):
    assert _plan_module().plan(_report(*installs)) == want


def _wheel(folder: Path, name: str, version: str, requires=()) -> None:
    """A minimal pure-Python wheel pip accepts: METADATA, WHEEL and RECORD."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                      + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text)}\n" for path, text in files.items())
    files[f"{stem}.dist-info/RECORD"] = record + f"{stem}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.parametrize("cuda", [True, False])
def test_plan_from_pips_own_dry_run(tmp_path, cuda):
    """pip's real report for a torch 2.13.0 that needs an nvidia package (PyPI's Linux
    wheel) and for a +cpu one, found offline in a folder of wheels made here."""
    if cuda:
        _wheel(tmp_path, "torch", "2.13.0", ["nvidia-cuda-runtime-cu12==12.8.90"])
        _wheel(tmp_path, "nvidia-cuda-runtime-cu12", "12.8.90")
    else:
        _wheel(tmp_path, "torch", "2.13.0+cpu")
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_CONSTRAINT", None)
    # --ignore-installed: this environment has a torch already; the report must list the new one.
    report = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                             "--report", "-", "torch==2.13.0"], env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    got = subprocess.run([sys.executable, str(PLAN)], input=report.stdout, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == ("cuda" if cuda else "cpu")


def test_install_script_is_valid_bash_and_documents_the_override():
    script = REPO / "scripts" / "install.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert '"torch==2.13.0"' in text and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in text
    assert "torch_install_plan.py" in text and json.dumps("https://download.pytorch.org/whl/cpu") in text
