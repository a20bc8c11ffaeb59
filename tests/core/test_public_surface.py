"""The adapters (zero_strategy/integrations) use only the core's public surface.

docs/architecture.md ("The public surface") promises that the Lightning and Accelerate
integrations are written against the same API a user has: the names in
``zero_strategy.__all__``, the ``__all__`` of the documented submodules below, and the
public members of the objects those return.  This reads every file under integrations/
and fails on an import of anything else from the core, on ``zero_strategy.<name>`` for a
name that is not exported, and on reads of an engine's or communicator's private members
or of its internal parts (units, communicator, phase, loss scaler, ...).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import zero_strategy

INTEGRATIONS = Path(zero_strategy.__file__).resolve().parent.parent / "integrations"
PUBLIC_SUBMODULES = ("zero_strategy.agreement", "zero_strategy.checkpoint", "zero_strategy.materialize",
                     "zero_strategy.startup")
# Engine members that are its parts, not its API (each has a public question instead;
# ``engine.policies``, the config's answers, is public: docs/core.md "Configuration").
ENGINE_INTERNALS = {"units", "comm", "phase", "scaler", "reducer", "gatherer", "orig_dtype_by_id",
                    "param_places_of", "trainable_units", "untouched", "disk_offload", "optimizer_set"}


def _allowed(module: str) -> set:
    if module == "zero_strategy":
        return set(zero_strategy.__all__)
    if module in PUBLIC_SUBMODULES:
        return set(importlib.import_module(module).__all__)
    return set()


def _violations():
    found = []
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(INTEGRATIONS.parent)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zero_strategy" \
                    and not node.module.startswith("zero_strategy.integrations"):
                for alias in node.names:
                    if alias.name not in _allowed(node.module):
                        found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    if name.startswith("zero_strategy.") and not name.startswith("zero_strategy.integrations") \
                            and name not in PUBLIC_SUBMODULES:
                        found.append(f"{where}:{node.lineno}: import {name}")
            elif isinstance(node, ast.Attribute):
                base = ast.get_source_segment(text, node.value) or ""
                if base == "zero_strategy" and node.attr not in zero_strategy.__all__ \
                        and f"zero_strategy.{node.attr}" not in PUBLIC_SUBMODULES:
                    found.append(f"{where}:{node.lineno}: zero_strategy.{node.attr}")
                last = base.split(".")[-1]
                if last.endswith("engine") or last in ("e", "comm"):
                    if (node.attr.startswith("_") and not node.attr.startswith("__")) or node.attr in ENGINE_INTERNALS:
                        found.append(f"{where}:{node.lineno}: {base}.{node.attr}")
    return found


def test_integrations_use_only_the_public_surface():
    found = _violations()
    assert not found, "integrations/ reaches past the public API:\n  " + "\n  ".join(found)


def test_the_check_itself_sees_a_private_read(tmp_path, monkeypatch):
    # The scan must be able to fail: a file reading private state is reported.
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "bad.py").write_text(
        "from zero_strategy.guard import lift_guard\nimport zero_strategy\n"
        "def f(engine):\n    return engine.units, engine._handles, zero_strategy.engine, engine.comm.group\n")
    monkeypatch.setattr(__import__(__name__), "INTEGRATIONS", tmp_path / "integrations")
    found = _violations()
    assert any("zero_strategy.guard import lift_guard" in f for f in found)
    assert any("engine.units" in f for f in found) and any("engine._handles" in f for f in found)
    assert any("zero_strategy.engine" in f for f in found) and any("engine.comm" in f for f in found)


def test_public_submodules_declare_what_they_offer():
    for name in PUBLIC_SUBMODULES:
        module = importlib.import_module(name)
        assert module.__all__, name
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.__all__ names {attr}, which it lacks"
    for attr in zero_strategy.__all__:
        assert hasattr(zero_strategy, attr), attr
