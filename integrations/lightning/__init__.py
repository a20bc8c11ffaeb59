"""Lightning integration: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

Names "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload" and "zero" are registered in every Lightning namespace
present (``lightning.pytorch``, ``pytorch_lightning``, ``lightning.fabric``,
``lightning_fabric``) by the start-up hook in ``zero_strategy_autoload`` as soon as the
namespace's ``strategies`` package is imported -- the user's script imports nothing
from this project.  Importing this package does the same for namespaces already
imported (the fallback where .pth files are not processed).

Classes, for passing an instance with options::

    from integrations.lightning import ZeroStrategy          # lightning.pytorch
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, reduce_bucket_size=5e7))

    from integrations.lightning import strategy_class
    PLZeroStrategy = strategy_class("pytorch_lightning")     # the standalone package

    from integrations.lightning import ZeroFabricStrategy    # lightning.fabric

This module stays cheap to import: registration stores lazy factories, and the
strategy classes (which import Lightning and the core) are built on first use.
"""
from __future__ import annotations

import sys

from ._common import STRATEGY_NAMES

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
    _register_from_hook(module, "trainer", ("lightning.pytorch", "pytorch_lightning"), "StrategyRegistry")


def register_fabric_strategies(module=None) -> None:
    """Start-up hook target for ``lightning.fabric.strategies`` / ``lightning_fabric.strategies``."""
    _register_from_hook(module, "fabric", ("lightning.fabric", "lightning_fabric"), "STRATEGY_REGISTRY")


def register_all() -> None:
    """Register in every Lightning namespace that is installed (imports them)."""
    import importlib

    for ns, fn in (("lightning.pytorch", register_trainer_strategies), ("pytorch_lightning", register_trainer_strategies),
                   ("lightning.fabric", register_fabric_strategies), ("lightning_fabric", register_fabric_strategies)):
        try:
            fn(importlib.import_module(f"{ns}.strategies"))
        except ImportError:
            pass


def strategy_class(namespace: str = "lightning.pytorch") -> type:
    from .trainer import trainer_classes

    return trainer_classes(namespace)[0]


def fabric_strategy_class(namespace: str = "lightning.fabric") -> type:
    from .fabric import fabric_classes

    return fabric_classes(namespace)[0]


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
    if name in ("ZeroStrategy", "ZeroPrecision"):
        from .trainer import trainer_classes

        ns = "lightning.pytorch" if _has("lightning") else "pytorch_lightning"
        return trainer_classes(ns)[0 if name == "ZeroStrategy" else 1]
    if name in ("ZeroFabricStrategy", "ZeroFabricPrecision"):
        from .fabric import fabric_classes

        ns = "lightning.fabric" if _has("lightning") else "lightning_fabric"
        return fabric_classes(ns)[0 if name == "ZeroFabricStrategy" else 1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has(top: str) -> bool:
    import importlib.util

    return top in sys.modules or importlib.util.find_spec(top) is not None


# Importing the package explicitly registers in namespaces already imported.
register_trainer_strategies()
register_fabric_strategies()
