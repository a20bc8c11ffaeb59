"""Run an unchanged Accelerate / Trainer script with ZeRO where start-up hooks are unavailable.

Two forms::

    # 1. As the launcher: `accelerate launch` that understands a zero_config: section.
    python -m zero_strategy.integrations.accelerate.run launch --config_file zero3.yaml train.py --lr 1e-3

    # 2. As what each worker runs, under the stock launcher (its config file must not
    #    contain zero_config:, so the section comes from --zero_config or the environment).
    accelerate launch --config_file ddp.yaml -m zero_strategy.integrations.accelerate.run \
        --zero_config zero3.yaml train.py --lr 1e-3

``--zero_config`` takes an accelerate config file with a ``zero_config:`` section or a
file holding just the section; ``-m module`` runs a module instead of a script.  Form 1
starts its workers through form 2, so neither needs the ``.pth`` start-up hook.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from . import hooks, settings

_USAGE = (
    "usage: python -m zero_strategy.integrations.accelerate.run launch [accelerate launch arguments] script.py [args]\n"
    "   or: python -m zero_strategy.integrations.accelerate.run [--zero_config FILE] (script.py | -m module) [args]"
)


def _launch(argv: List[str]) -> None:
    """``accelerate launch`` with the config-section hook, workers started through this runner."""
    hooks.install_config_section()
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    target = ["-m", args.training_script] if args.module else [args.training_script]
    args.training_script_args = target + list(args.training_script_args)
    args.training_script = "zero_strategy.integrations.accelerate.run"
    args.module = True
    launch_command(args)


def _run(argv: List[str]) -> None:
    zero_config_file: Optional[str] = None
    while argv and argv[0].startswith("--zero_config"):
        option = argv.pop(0)
        if "=" in option:
            zero_config_file = option.split("=", 1)[1]
        elif argv:
            zero_config_file = argv.pop(0)
        else:
            raise SystemExit("--zero_config needs a file\n" + _USAGE)
    if not argv:
        raise SystemExit(_USAGE)
    if zero_config_file is not None:
        settings.export(settings.read_file(zero_config_file))
    elif not os.environ.get(settings.ENV_VAR):
        raise SystemExit(
            f"no ZeRO configuration: pass --zero_config FILE, set {settings.ENV_VAR}, or start with "
            "`python -m zero_strategy.integrations.accelerate.run launch --config_file <config with zero_config:> ...`"
        )
    hooks.install_accelerator()
    # The same import hooks the .pth file would install (zero3_init_flag needs the one on
    # transformers.modeling_utils, which the script has not imported yet).
    import zero_strategy_autoload

    zero_strategy_autoload.install()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(_USAGE)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv and argv[0] == "launch":
        _launch(argv[1:])
    else:
        _run(argv)


if __name__ == "__main__":
    main()
