"""Standalone twins: our Lightning classes for ``pytorch_lightning`` / ``lightning_fabric``.

Why: Lightning is published twice from one code base -- as ``lightning.pytorch`` and
``lightning.fabric`` inside the ``lightning`` package, and as the standalone packages
``pytorch_lightning`` and ``lightning_fabric`` (which Lightning's build produces by
renaming the imports).  The two copies have separate base classes, registries,
launchers and rank-zero helpers, so ``pytorch_lightning.Trainer`` needs a strategy
that subclasses ``pytorch_lightning``'s ``ParallelStrategy`` and uses
``lightning_fabric``'s utilities.

How: the modules that subclass Lightning (``trainer``, ``fabric``, ``_process_group``)
are written once, as ordinary module-level classes against ``lightning.*``.  For the
standalone packages, :func:`standalone` executes the same module's compiled code a
second time, as a separate module ``<name>_standalone``, with an ``__import__`` that
renames imports the way Lightning's build does (``lightning.pytorch`` ->
``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``) and sends
relative imports of our other twinned modules to their twins.  Every name in a twin --
its bases, ``isinstance`` checks, zero-argument ``super()``, the launcher, the
rank-zero helpers -- is therefore the standalone package's, exactly as if the file
had been copied and edited, but there is one definition.  Lazy imports inside
functions are renamed too (a module's functions share its builtins).  The twin runs
without the ``lightning`` package being installed at all.

Rules for a twinned module: import Lightning as ``from lightning.<x> import <name>``
(``import lightning.pytorch`` binds the top-level package ``lightning``, which has no
standalone counterpart; it raises ImportError here), and import our twinned modules
relatively (``from ._process_group import ...``).
"""
from __future__ import annotations

import builtins
import importlib.util
import sys
import threading
from types import ModuleType

# Lightning's own rename, prefix for prefix.
RENAMES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
SUFFIX = "_standalone"
PACKAGE = __name__.rpartition(".")[0]
# Our modules written against lightning.* (the ones that get a twin).
TWINNED = frozenset(f"{PACKAGE}.{name}" for name in ("trainer", "fabric", "_process_group"))

_lock = threading.RLock()  # reentrant: building one twin builds the twins it imports


def renamed(name: str) -> str:
    """``name`` in the standalone packages (unchanged if it is not a Lightning module)."""
    for old, new in RENAMES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def standalone(name: str) -> ModuleType:
    """The twin of our module ``name`` (one of :data:`TWINNED`), built on first use."""
    if name not in TWINNED:
        raise ValueError(f"{name} has no standalone twin (twinned: {sorted(TWINNED)})")
    twin_name = name + SUFFIX
    with _lock:
        twin = sys.modules.get(twin_name)
        if twin is not None:
            return twin
        spec = importlib.util.find_spec(name)
        code = spec.loader.get_code(name)
        twin = ModuleType(twin_name, None)
        twin.__file__ = spec.origin  # tracebacks and inspect show the one source file
        twin.__package__ = PACKAGE
        twin.__spec__ = importlib.util.spec_from_loader(twin_name, loader=None, origin=spec.origin)
        twin.__builtins__ = dict(vars(builtins), __import__=_renaming_import)
        sys.modules[twin_name] = twin
        try:
            exec(code, vars(twin))
        except BaseException:
            del sys.modules[twin_name]
            raise
        return twin


def _renaming_import(name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` of the twins (see the module docstring)."""
    if level:
        target = importlib.util.resolve_name("." * level + name, PACKAGE)
        if target in TWINNED:
            return standalone(target)  # relative imports always have a fromlist
        if any(f"{target}.{item}" in TWINNED for item in fromlist or ()):
            raise ImportError(f"a twinned module must import our twinned modules as 'from .module import name' "
                              f"(got 'from {'.' * level}{name} import {', '.join(fromlist)}')")
        return builtins.__import__(name, globals, locals, fromlist, level)
    new = renamed(name)
    if new != name and not fromlist:
        raise ImportError(f"a twinned module must import {name} as 'from {name} import ...' (see {__name__})")
    return builtins.__import__(new, globals, locals, fromlist, level)
