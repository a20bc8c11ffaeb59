"""Lightning integration: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

Names "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload" and "zero" are registered in every Lightning namespace
present (``lightning.pytorch``, ``pytorch_lightning``, ``lightning.fabric``,
``lightning_fabric``) by the start-up hook in ``zero_strategy_autoload`` as soon as the
namespace's ``strategies`` package is imported -- the user's script imports nothing
from this project.  Importing this package does the same for namespaces already
imported (the fallback where .pth files are not processed).

Classes, for passing an instance with options::

    from zero_strategy.integrations.lightning import ZeroStrategy          # lightning.pytorch
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, reduce_bucket_size=5e7))

    from zero_strategy.integrations.lightning import strategy_class
    PLZeroStrategy = strategy_class("pytorch_lightning")     # the standalone package

    from zero_strategy.integrations.lightning import ZeroFabricStrategy    # lightning.fabric

This module stays cheap to import: registration stores lazy factories, and the
modules with the strategy classes (which import Lightning) are imported on first use.
The classes are written once, against ``lightning.*`` (``trainer``, ``fabric``); the
standalone packages get twins made from the same code (see ``_twin``).
"""
from __future__ import annotations

import importlib
import sys

from ._common import STRATEGY_NAMES
from ._messages import install_name_help, install_precision_note

__all__ = [
    "ZeroStrategy",
    "ZeroPrecision",
    "ZeroFabricStrategy",
    "ZeroFabricPrecision",
    "strategy_class",
    "fabric_strategy_class",
    "register_trainer_strategies",
    "register_fabric_strategies",
    "register_all",
    "consolidate_checkpoint",
    "release",
    "STRATEGY_NAMES",
]


# The Lightning distributions: first the one our modules are written against, then the
# standalone package that gets their twins.
TRAINER_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
FABRIC_NAMESPACES = ("lightning.fabric", "lightning_fabric")


class _LazyFactory:
    """What the registries store: builds the strategy class on the first ``get``."""

    def __init__(self, kind: str, namespace: str) -> None:
        self.kind = kind
        self.namespace = namespace

    def __call__(self, **init_params):
        cls = strategy_class(self.namespace) if self.kind == "trainer" else fabric_strategy_class(self.namespace)
        return cls(**init_params)

    def __repr__(self) -> str:
        return f"<zero_strategy {self.kind} strategy for {self.namespace}>"


def _register(registry, kind: str, namespace: str) -> None:
    factory = _LazyFactory(kind, namespace)
    for name, (params, description) in STRATEGY_NAMES.items():
        if name in registry:
            continue  # never replace a user's own registration (or ours, twice)
        registry.register(name, factory, description=description, **params)
    # What the connectors say about a mistyped name and about AMP (see _messages).
    install_name_help(registry)
    install_precision_note()


def _register_from_hook(module, kind: str, namespaces, registry_attr: str) -> None:
    # Called with the strategies module by the start-up hook; without it, for every
    # distribution already imported.
    if module is None:
        for ns in namespaces:
            if f"{ns}.strategies" in sys.modules:
                _register_from_hook(sys.modules[f"{ns}.strategies"], kind, namespaces, registry_attr)
        return
    namespace = module.__name__.rsplit(".", 1)[0]
    _register(getattr(module, registry_attr), kind, namespace)


def register_trainer_strategies(module=None) -> None:
    """Start-up hook target for ``lightning.pytorch.strategies`` / ``pytorch_lightning.strategies``."""
    _register_from_hook(module, "trainer", TRAINER_NAMESPACES, "StrategyRegistry")


def register_fabric_strategies(module=None) -> None:
    """Start-up hook target for ``lightning.fabric.strategies`` / ``lightning_fabric.strategies``."""
    _register_from_hook(module, "fabric", FABRIC_NAMESPACES, "STRATEGY_REGISTRY")


def register_all() -> None:
    """Register in every Lightning namespace that is installed (imports them)."""
    for ns, fn in (("lightning.pytorch", register_trainer_strategies), ("pytorch_lightning", register_trainer_strategies),
                   ("lightning.fabric", register_fabric_strategies), ("lightning_fabric", register_fabric_strategies)):
        try:
            fn(importlib.import_module(f"{ns}.strategies"))
        except ImportError:
            pass


def _module_for(module: str, namespace: str, namespaces):
    """Our module ``module`` for the Lightning distribution ``namespace``."""
    if namespace not in namespaces:
        raise ValueError(f"namespace must be one of {namespaces}, got {namespace!r}")
    name = f"{__name__}.{module}"
    if namespace == namespaces[0]:
        return importlib.import_module(name)
    from ._twin import standalone

    return standalone(name)


def strategy_class(namespace: str = "lightning.pytorch") -> type:
    """``ZeroStrategy`` for the Trainer of ``namespace`` ("lightning.pytorch" or "pytorch_lightning")."""
    return _module_for("trainer", namespace, TRAINER_NAMESPACES).ZeroStrategy


def fabric_strategy_class(namespace: str = "lightning.fabric") -> type:
    """``ZeroFabricStrategy`` for ``namespace`` ("lightning.fabric" or "lightning_fabric")."""
    return _module_for("fabric", namespace, FABRIC_NAMESPACES).ZeroFabricStrategy


def release(module) -> None:
    """Give ``module`` back whole parameters and detach its engine (collective: all ranks).

    After ``fit`` with a ZeRO strategy the LightningModule stays partitioned (stage 3)
    and managed; call this before handing it to another strategy or using it alone."""
    from ._common import release_engine

    release_engine(module)


def consolidate_checkpoint(checkpoint_dir, output_file=None):
    from .consolidate import consolidate_checkpoint as _consolidate

    return _consolidate(checkpoint_dir, output_file)


def __getattr__(name: str):
    # The classes of the ``lightning`` package when it is installed, else the standalone ones.
    if name in ("ZeroStrategy", "ZeroPrecision"):
        ns = TRAINER_NAMESPACES[0] if _has("lightning") else TRAINER_NAMESPACES[1]
        return getattr(_module_for("trainer", ns, TRAINER_NAMESPACES), name)
    if name in ("ZeroFabricStrategy", "ZeroFabricPrecision"):
        ns = FABRIC_NAMESPACES[0] if _has("lightning") else FABRIC_NAMESPACES[1]
        return getattr(_module_for("fabric", ns, FABRIC_NAMESPACES), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has(top: str) -> bool:
    import importlib.util

    if top in sys.modules:
        return sys.modules[top] is not None  # None: an import of it is blocked
    return importlib.util.find_spec(top) is not None


# Importing the package explicitly registers in namespaces already imported.
register_trainer_strategies()
register_fabric_strategies()
