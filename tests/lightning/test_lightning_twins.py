"""The standalone twins (``pytorch_lightning`` / ``lightning_fabric``) of the Lightning
strategy classes, made from the one definition written against ``lightning.*``.

Training through the twins is covered in test_lightning.py; these checks are about how
they are made: each twin belongs wholly to its distribution and shares the source.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

from zero_strategy.integrations.lightning import _twin, fabric_strategy_class, strategy_class  # noqa: E402

# distribution -> the other one, whose classes must not appear in its twin
TRAINER = {"lightning.pytorch": "pytorch_lightning", "pytorch_lightning": "lightning.pytorch"}
FABRIC = {"lightning.fabric": "lightning_fabric", "lightning_fabric": "lightning.fabric"}


def _framework_modules(cls):
    return {k.__module__ for k in cls.__mro__ if not k.__module__.startswith(("zero_strategy", "builtins", "abc"))}


@pytest.mark.parametrize("namespace", list(TRAINER))
def test_trainer_twin_belongs_to_its_distribution(namespace):
    cls = strategy_class(namespace)
    own_fabric = "lightning.fabric" if namespace == "lightning.pytorch" else "lightning_fabric"
    precision = cls(stage=2).precision_plugin  # the default plugin, built by the class itself
    for k in (cls, type(precision)):
        modules = _framework_modules(k)
        assert modules and all(m.startswith((namespace, own_fabric)) for m in modules), (k, modules)
    assert cls.script_launcher_class.__module__.startswith(namespace)
    mixin = next(k for k in cls.__mro__ if k.__name__ == "ZeroProcessGroupMixin")
    assert mixin.barrier.__globals__["dist_utils"].__name__.startswith(own_fabric)


@pytest.mark.parametrize("namespace", list(FABRIC))
def test_fabric_twin_belongs_to_its_distribution(namespace):
    cls = fabric_strategy_class(namespace)
    strategy = cls(stage=1)
    for k in (cls, type(strategy.precision), type(strategy._backward_sync_control)):
        modules = _framework_modules(k)
        assert modules and all(m.startswith(namespace) for m in modules), (k, modules)
    assert cls.script_launcher_class.__module__.startswith(namespace)


def test_twins_share_one_definition():
    pairs = [(strategy_class("lightning.pytorch"), strategy_class("pytorch_lightning")),
             (fabric_strategy_class("lightning.fabric"), fabric_strategy_class("lightning_fabric"))]
    for original, twin in pairs:
        assert original is not twin and original.__name__ == twin.__name__
        assert inspect.getsourcefile(original) == inspect.getsourcefile(twin)
        assert sorted(vars(original)) == sorted(vars(twin))
        assert twin.__module__ == original.__module__ + _twin.SUFFIX
    assert strategy_class("pytorch_lightning") is strategy_class("pytorch_lightning")  # built once


def test_import_forms_a_twin_cannot_rename_are_refused():
    with pytest.raises(ImportError, match="from lightning.pytorch import"):
        _twin._renaming_import("lightning.pytorch", {}, {}, None, 0)
    with pytest.raises(ImportError, match="from .module import name"):
        _twin._renaming_import("", {"__package__": _twin.PACKAGE}, {}, ("trainer",), 1)
    renamed = _twin._renaming_import("lightning.fabric.utilities", {}, {}, ("seed",), 0)
    assert renamed.__name__ == "lightning_fabric.utilities"


def test_standalone_twin_needs_no_lightning_package(tmp_path):
    """With only pytorch_lightning installed (``lightning`` made unimportable here), the
    Trainer and Fabric twins work and nothing of ``lightning.*`` is imported."""
    code = """
        import sys

        sys.modules["lightning"] = None  # as if not installed: every lightning.* import fails
        import pytorch_lightning as PL
        import lightning_fabric as LF
        trainer = PL.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        assert type(trainer.strategy).__name__ == "ZeroStrategy", type(trainer.strategy)
        assert isinstance(trainer.strategy, PL.strategies.ParallelStrategy)
        fabric = LF.Fabric(strategy="zero2", accelerator="cpu", devices=1)
        assert type(fabric.strategy).__name__ == "ZeroFabricStrategy", type(fabric.strategy)
        from zero_strategy.integrations.lightning import ZeroStrategy  # falls back to the twin
        assert ZeroStrategy is type(trainer.strategy)
        leaked = sorted(m for m in sys.modules if m.startswith("lightning."))
        assert sys.modules["lightning"] is None
        assert not leaked, leaked
        print("ok")
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
