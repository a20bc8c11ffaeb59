"""The start-up hook (zero_strategy_autoload + its .pth) and the name registration.

Each check runs a fresh interpreter, since what is tested is interpreter start-up.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code, env_extra=None, cwd=None, timeout=180):
    env = dict(os.environ)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_pth_file_is_installed_in_this_environment():
    pth = Path(sysconfig.get_paths()["purelib"]) / "zero_strategy_autoload.pth"
    assert pth.is_file(), f"{pth} missing: reinstall with pip install -e ."
    assert "zero_strategy_autoload" in pth.read_text()


def test_hook_adds_only_itself_to_interpreter_start():
    """Stdlib-only, nothing imported eagerly: at start-up the hook module is the only
    non-stdlib module it brings, and installing the finder imports nothing at all."""
    code = """
        import sys
        finders = [type(f).__name__ for f in sys.meta_path]
        print(' '.join(sorted(sys.modules)))
        print(' '.join(finders))
    """
    on_mods, on_finders = _python(code).stdout.splitlines()
    off_mods, off_finders = _python(code, {"ZERO_STRATEGY_AUTOLOAD": "0"}).stdout.splitlines()
    assert on_finders.split()[0] == "PostImportFinder" and "PostImportFinder" not in off_finders
    assert set(on_mods.split()) == set(off_mods.split())
    foreign = {m.split(".")[0] for m in on_mods.split()} - set(sys.stdlib_module_names)
    foreign = {m for m in foreign if not m.startswith("__editable__") and m not in ("_distutils_hack", "__main__")}
    assert foreign == {"zero_strategy_autoload"}, foreign


def test_hook_runs_targets_after_import_and_survives_failures(tmp_path):
    pkg = tmp_path / "fakefw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "strategies.py").write_text("REGISTRY = {}\nLOADER = __loader__\n")
    (pkg / "other.py").write_text("X = 1\n")
    (tmp_path / "fakehooks.py").write_text(textwrap.dedent("""
        CALLS = []
        def register(module):
            CALLS.append(module.__name__)
            module.REGISTRY["zero3"] = "registered"
        def broken(module):
            raise RuntimeError("boom")
    """))
    out = _python(f"""
        import sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        import zero_strategy_autoload as za
        za.TARGETS["fakefw.strategies"] = ("fakehooks:register", "fakehooks:broken", "nothere:f")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fakefw.strategies as s
            import fakefw.other
        import fakehooks
        assert s.REGISTRY == {{"zero3": "registered"}}, s.REGISTRY
        assert fakehooks.CALLS == ["fakefw.strategies"], fakehooks.CALLS
        # the real loader is back in place, during the module's execution and after
        assert type(s.__loader__).__name__ == "SourceFileLoader", s.__loader__
        assert s.LOADER is s.__loader__ and s.__spec__.loader is s.__loader__
        messages = [str(w.message) for w in caught]
        assert any("fakehooks:broken" in m and "boom" in m for m in messages), messages
        assert any("nothere:f" in m for m in messages), messages
        # idempotent install; a target already imported gets its hooks at install time
        za.install(); za.install()
        assert sum(type(f).__name__ == "PostImportFinder" for f in sys.meta_path) == 1
        print("ok")
    """)
    assert out.stdout.strip().endswith("ok")


def test_strategy_names_registered_without_importing_this_project():
    """The user's script imports only Lightning; the names resolve lazily (the strategy
    classes are not imported until a strategy object is actually built)."""
    out = _python("""
        import sys
        import lightning.pytorch
        from lightning.pytorch.strategies import StrategyRegistry
        import pytorch_lightning
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning_fabric.strategies import STRATEGY_REGISTRY as LFRegistry
        names = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero")
        for registry in (StrategyRegistry, PLRegistry, STRATEGY_REGISTRY, LFRegistry):
            assert all(n in registry for n in names), registry
        # Registering imports zero_strategy.integrations.lightning, hence the (light) core
        # package above it, but not the strategy modules.
        lazy = ("trainer", "fabric", "trainer_standalone", "fabric_standalone")
        assert not [m for m in lazy if "zero_strategy.integrations.lightning." + m in sys.modules]
        s = StrategyRegistry.get("zero3")
        assert type(s).__name__ == "ZeroStrategy" and s.config.stage == 3
        assert isinstance(s, lightning.pytorch.strategies.ParallelStrategy)
        p = PLRegistry.get("zero1")
        assert isinstance(p, pytorch_lightning.strategies.ParallelStrategy) and p.config.stage == 1
        f = STRATEGY_REGISTRY.get("zero2")
        import lightning.fabric.strategies as lfs
        assert isinstance(f, lfs.ParallelStrategy) and f.config.stage == 2
        # options are validated when the strategy is built, not in a collective later
        from zero_strategy.integrations.lightning import ZeroStrategy
        try:
            ZeroStrategy(stage=3, reduce_bukcet_size=10)
        except ValueError as e:
            assert "reduce_bucket_size" in str(e), e
        else:
            raise AssertionError("a misspelt option was accepted")
        print("ok")
    """)
    assert out.stdout.strip().endswith("ok")


def test_explicit_import_is_the_fallback_without_pth():
    out = _python("""
        import lightning.pytorch
        from lightning.pytorch.strategies import StrategyRegistry
        assert "zero3" not in StrategyRegistry
        import zero_strategy.integrations.lightning
        assert "zero3" in StrategyRegistry
        print("ok")
    """, {"ZERO_STRATEGY_AUTOLOAD": "0"})
    assert out.stdout.strip().endswith("ok")


def test_wheel_and_editable_wheel_carry_the_pth(tmp_path):
    """Both ``pip install .`` (a wheel) and ``pip install -e .`` (an editable wheel, PEP 660)
    put zero_strategy_autoload.pth at the top of site-packages.  Built from a copy of the
    project with the environment's setuptools (what pip's build backend runs)."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "zero_strategy_autoload.py"):
        shutil.copy(ROOT / name, src / name)
    for name in ("zero_strategy", "integrations"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    _python(f"""
        import os
        os.chdir({str(src)!r})
        from setuptools import build_meta
        build_meta.build_wheel({str(dist)!r})
        build_meta.build_editable({str(dist)!r})
    """, cwd=src, timeout=300)
    wheels = {("editable" in w.name): w for w in dist.glob("*.whl")}
    assert set(wheels) == {True, False}, list(dist.iterdir())
    for editable, wheel in wheels.items():
        names = zipfile.ZipFile(wheel).namelist()
        assert "zero_strategy_autoload.pth" in names, (wheel.name, names)
        if not editable:
            assert "zero_strategy_autoload.py" in names and "zero_strategy/integrations/lightning/__init__.py" in names
            assert not any(n.startswith("integrations/") for n in names), "a top-level integrations package"
        pth = zipfile.ZipFile(wheel).read("zero_strategy_autoload.pth").decode()
        assert pth.startswith("import ") and "zero_strategy_autoload" in pth
