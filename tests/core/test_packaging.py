"""The integrations are installed as ``zero_strategy.integrations``, never as a
top-level ``integrations`` package (a user's own ``integrations/`` folder would shadow
it and ``Trainer(strategy="zero3")`` would stop resolving).

Each check runs a fresh interpreter from a directory outside the repository, as a
user's project would; the repository root on ``sys.path`` would hide the problem.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _python(code, cwd, timeout=240):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_users_own_integrations_package_does_not_shadow_ours(tmp_path):
    user_pkg = tmp_path / "integrations"
    user_pkg.mkdir()
    (user_pkg / "__init__.py").write_text("USERS_OWN = True\n")
    out = _python("""
        import integrations
        assert integrations.USERS_OWN, "the user's package must stay the user's"
        import lightning.pytorch as L
        trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        from zero_strategy.integrations.lightning import ZeroStrategy
        assert type(trainer.strategy) is ZeroStrategy, type(trainer.strategy)
        assert trainer.strategy.config.stage == 3
        print("ok")
    """, cwd=tmp_path)
    assert out.strip().endswith("ok")


def test_no_top_level_integrations_package_is_installed(tmp_path):
    out = _python("""
        import importlib.util
        assert importlib.util.find_spec("integrations") is None, importlib.util.find_spec("integrations")
        import zero_strategy.integrations.lightning, zero_strategy.integrations.accelerate
        print("ok")
    """, cwd=tmp_path)
    assert out.strip().endswith("ok")


def test_core_imports_no_integration_and_no_framework(tmp_path):
    """``import zero_strategy`` must not pull in Lightning, Accelerate or transformers."""
    out = _python("""
        import sys
        import zero_strategy
        frameworks = {"lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers"}
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in frameworks or m.startswith("zero_strategy.integrations"))
        assert not loaded, loaded
        print("ok")
    """, cwd=tmp_path)
    assert out.strip().endswith("ok")


def test_command_line_modules_run_under_the_new_name(tmp_path):
    for module in ("zero_strategy.integrations.lightning.consolidate", "zero_strategy.integrations.accelerate.run"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, (module, proc.stderr[-4000:])
        assert module in proc.stdout, (module, proc.stdout[-2000:])
