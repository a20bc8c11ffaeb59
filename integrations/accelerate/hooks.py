"""Start-up hooks: the two places where this integration enters Accelerate.

Each function is what one ``TARGETS`` entry of the repository's start-up hook
(``zero_strategy_autoload``) names; it runs right after the named module has
finished importing:

* ``accelerate.commands.config.config_args`` -> :func:`install_config_section`: in the
  ``accelerate launch`` process, a ``zero_config:`` section is taken out of the config
  file before accelerate checks the file's keys, validated, and exported in
  :data:`~zero_strategy.integrations.accelerate.settings.ENV_VAR` for the workers.
* ``accelerate.accelerator`` -> :func:`install_accelerator`: in a worker where that
  variable is set, ``accelerate.Accelerator`` becomes
  :class:`~zero_strategy.integrations.accelerate.accelerator.ZeroAccelerator` (a no-op otherwise).

``python -m zero_strategy.integrations.accelerate.run`` calls the same functions where start-up
hooks are unavailable.  Both are idempotent and accept (and ignore) the module the
start-up hook may pass.
"""
from __future__ import annotations

import os
import sys

from . import settings


def install_config_section(module=None) -> None:
    """Make accelerate's config loading accept (and export) a ``zero_config:`` section."""
    from accelerate.commands.config import config_args

    base = config_args.BaseConfig
    original = base.__dict__["process_config"]
    if getattr(original, "_zero_strategy", False):
        return
    original = original.__func__

    def process_config(config_dict):
        if isinstance(config_dict, dict) and settings.SECTION in config_dict:
            section = config_dict.pop(settings.SECTION)
            settings.check_distributed_type(config_dict.get("distributed_type"))
            # Before the launcher's own fp8 check (its message asks for an fp8 library).
            cli = settings.command_line_mixed_precision(sys.argv[1:])
            settings.check_mixed_precision(cli if cli is not None else config_dict.get("mixed_precision"))
            settings.export(section)
        return original(config_dict)

    process_config._zero_strategy = True
    base.process_config = staticmethod(process_config)


def install_accelerator(module=None) -> None:
    """In a worker launched with a ``zero_config`` section, swap in ZeroAccelerator."""
    # The section is validated by ZeroAccelerator.__init__, where an error reaches the
    # user (a start-up hook's errors are only reported as warnings).
    if not os.environ.get(settings.ENV_VAR):
        return
    accelerator_module = sys.modules.get("accelerate.accelerator")
    if accelerator_module is None:
        import accelerate.accelerator as accelerator_module
    from .accelerator import ZeroAccelerator

    if accelerator_module.Accelerator is ZeroAccelerator:
        return
    accelerator_module.Accelerator = ZeroAccelerator
    # When called after `accelerate` finished importing (the runner), rebind the names
    # already taken from it too.
    for name in ("accelerate", "transformers.trainer"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "Accelerator", None) is not None:
            mod.Accelerator = ZeroAccelerator
