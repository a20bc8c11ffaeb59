"""Register zero_strategy's framework integrations when a framework is imported.

Why: Lightning looks strategy names up in a registry and has no entry-point group for
strategies, so ``Trainer(strategy="zero3")`` only works if something registers "zero3"
before the Trainer is built -- without the user importing this project.

How: ``zero_strategy_autoload.pth`` (installed into site-packages by ``pip install .``
and ``pip install -e .``) imports this module at every interpreter start.  ``install()``
puts one finder at the front of ``sys.meta_path``.  For module names in ``TARGETS`` it
lets the normal import run and then calls the hook functions named there with the
freshly executed module.  For every other import it costs one dict lookup.

This module is stdlib-only and must stay so: it runs in every Python process of the
environment.  Nothing it does may break interpreter start-up or the import it hooks:
errors in hooks are caught and reported as a RuntimeWarning.

Extending (e.g. the Accelerate integration)::

    TARGETS = {
        ...,
        "accelerate.accelerator": "zero_strategy.integrations.accelerate.autoload:patch_accelerator",
    }

Keys are fully qualified module names; values are ``"package.module:function"`` or a
tuple of such strings.  Each function is called as ``function(module)`` right after
``module`` finished executing (or at ``install()`` time if it was already imported).
Keep hook modules light: they run inside the framework's own import, so import heavy
dependencies lazily (inside the functions the framework calls later).

Turn it off with the environment variable ``ZERO_STRATEGY_AUTOLOAD=0``.  Where .pth
files are not processed (``python -S``, some embedded interpreters), import the
integration yourself (``import zero_strategy.integrations.lightning``) or pass a strategy object.
"""
import sys

TARGETS = {
    # Lightning Trainer: both distributions of the package have their own registry.
    "lightning.pytorch.strategies": "zero_strategy.integrations.lightning:register_trainer_strategies",
    "pytorch_lightning.strategies": "zero_strategy.integrations.lightning:register_trainer_strategies",
    # Lightning Fabric.
    "lightning.fabric.strategies": "zero_strategy.integrations.lightning:register_fabric_strategies",
    "lightning_fabric.strategies": "zero_strategy.integrations.lightning:register_fabric_strategies",
    # Accelerate: `accelerate launch` accepts a zero_config: section in its config file
    # and exports it; workers launched with it get the ZeRO Accelerator.
    "accelerate.commands.config.config_args": "zero_strategy.integrations.accelerate.hooks:install_config_section",
    "accelerate.accelerator": "zero_strategy.integrations.accelerate.hooks:install_accelerator",
    # zero3_init_flag: from_pretrained builds stage-3 models partitioned in such workers.
    "transformers.modeling_utils": "zero_strategy.integrations.accelerate.loading:install_from_environment",
}

_ENV_SWITCH = "ZERO_STRATEGY_AUTOLOAD"


def _warn(message):
    try:
        import warnings

        warnings.warn("zero_strategy_autoload: " + message, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - never let reporting break an import
        pass


def _targets_for(fullname):
    value = TARGETS.get(fullname)
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def run_hooks(fullname, module):
    """Call every hook registered for ``fullname`` with ``module``; never raises."""
    for target in _targets_for(fullname):
        try:
            mod_name, _, func_name = target.partition(":")
            __import__(mod_name)
            func = getattr(sys.modules[mod_name], func_name)
            func(module)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            _warn("hook %s for %s failed: %r" % (target, fullname, exc))


class _HookedLoader:
    """Wraps the real loader only for the moment of the import."""

    def __init__(self, loader, fullname):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # Hand the real loader back before the module's code runs, so nothing that
        # inspects __loader__ / __spec__.loader (resources, reload) ever sees this one.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)  # errors here are the import's own: propagate
        run_hooks(self._fullname, sys.modules.get(self._fullname, module))

    def __getattr__(self, name):  # anything else a loader may be asked for
        return getattr(self._loader, name)


class PostImportFinder:
    """``sys.meta_path`` finder that only reacts to the module names in ``TARGETS``."""

    def __init__(self):
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TARGETS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # namespace packages and legacy loaders: leave them alone
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


def install():
    """Install the finder once (idempotent) and run hooks for targets already imported."""
    for finder in sys.meta_path:
        if isinstance(finder, PostImportFinder) or type(finder).__name__ == "PostImportFinder":
            break
    else:
        sys.meta_path.insert(0, PostImportFinder())
    for name in list(TARGETS):
        module = sys.modules.get(name)
        if module is not None:
            run_hooks(name, module)


def _autoinstall():
    try:
        import os

        if os.environ.get(_ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
            return
        install()
    except Exception as exc:  # noqa: BLE001 - interpreter start-up must never break
        _warn("not installed: %r" % (exc,))


_autoinstall()
