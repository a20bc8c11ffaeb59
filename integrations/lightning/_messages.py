"""What Lightning tells the user about a strategy it does not know, and about precision,
made true for ZeRO.  Stdlib only: installed from the start-up registration.

[Note: a mistyped strategy name]
Both connectors (Trainer and Fabric) check ``name not in registry.available_strategies()``
and then raise a fixed message ("Example choices: auto, ddp, ddp_spawn, deepspeed, ...")
that cannot name ours.  The registry instance gets an ``available_strategies`` returning a
list whose membership test raises the same ValueError, with the ZeRO names and a
suggestion, for an unregistered name that looks like one of ours ("zero_3", "zero4",
"zer3").  Every other name, and every other use of the list (Fabric's CLI iterates it),
behaves as before.

[Note: the AMP message]
The connectors log "Using bfloat16 Automatic Mixed Precision (AMP)" before the strategy
sees the precision plugin.  Under ZeRO there is no autocast: the engine computes in 16 bits
with fp32 master weights.  A filter on Lightning's rank-zero loggers rewrites that record
when the connector logging it holds one of our strategies.
"""
from __future__ import annotations

import logging
import re
import sys

_MARK = "_zero_strategy_name_help"
_ZERO_LIKE = re.compile(r"^ze?ro?[\s_\-]*(\d*)", re.IGNORECASE)


def zero_names() -> dict:
    from ._common import STRATEGY_NAMES

    return {name: description for name, (_, description) in STRATEGY_NAMES.items()}


def _looks_like_zero(name: str, names) -> bool:
    import difflib

    return bool(_ZERO_LIKE.match(name)) or bool(difflib.get_close_matches(name, names, n=1, cutoff=0.75))


def unknown_name_message(name: str, registered) -> str:
    """The ValueError text for an unregistered ``name`` that looks like a ZeRO name."""
    import difflib

    names = zero_names()
    squeezed = re.sub(r"[\s_\-]", "", name.lower())
    stage = _ZERO_LIKE.match(name)
    if stage and stage.group(1) and int(stage.group(1)) not in (1, 2, 3):
        hint = f"ZeRO has stages 1, 2 and 3 (and 0, plain data parallelism: ZeroStrategy(stage=0)); there is no stage {stage.group(1)}."
    else:
        close = difflib.get_close_matches(squeezed, list(names), n=1, cutoff=0.6)
        hint = f"Did you mean {close[0]!r}?" if close else ""
    listing = "; ".join(f"{n} ({d.replace(' (zero_strategy)', '')})" for n, d in names.items())
    return (f"You selected an invalid strategy name: `strategy={name!r}`. {hint} ZeRO strategies (zero_strategy): "
            f"{listing}. Every registered name: {', '.join(sorted(registered))}.").replace("  ", " ")


class _StrategyNames(list):
    """``available_strategies()`` for the connectors: see the note on mistyped names."""

    def __contains__(self, item) -> bool:
        if list.__contains__(self, item):
            return True
        if isinstance(item, str) and _looks_like_zero(item.lower(), list(zero_names())):
            raise ValueError(unknown_name_message(item, list(self)))
        return False


def install_name_help(registry) -> None:
    """Make ``registry``'s connector check name the ZeRO strategies (idempotent)."""
    if getattr(registry, _MARK, False):
        return
    original = registry.available_strategies

    def available_strategies():
        return _StrategyNames(original())

    registry.available_strategies = available_strategies
    setattr(registry, _MARK, True)


# ----------------------------------------------------------------------------------------
# the AMP message
# ----------------------------------------------------------------------------------------
# Where the message is logged: lightning_utilities' rank-zero log is replaced on import by
# the Lightning distribution imported last.
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero",
                      "lightning.fabric.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                      "lightning_utilities.core.rank_zero")
_AMP = re.compile(r"^Using (16bit|16-bit|bfloat16) Automatic Mixed Precision \(AMP\)$")


def _connector_strategy():
    """The strategy of the connector whose ``_check_and_init_precision`` is logging."""
    frame = sys._getframe(1)
    for _ in range(25):
        if frame is None:
            return None
        if frame.f_code.co_name == "_check_and_init_precision":
            return getattr(frame.f_locals.get("self"), "strategy", None)
        frame = frame.f_back
    return None


def precision_note(precision_flag: str, autocast: bool = False) -> str:
    from ._common import requested_precision_flag

    fp16 = precision_flag == "16-mixed" or requested_precision_flag() in ("16-mixed", "16")
    dtype, extra = ("fp16", ", loss scaling in the engine") if fp16 else ("bf16", "")
    if autocast:
        note = (f"zero_strategy: {dtype} autocast inside the ZeRO engine (autocast=True): fp32 parameters, gradients "
                f"and optimizer shards, the forward under torch.autocast({dtype}){extra}; no GradScaler")
        if fp16 and precision_flag != "16-mixed":
            note += " (Lightning's fallback to bf16 on CPU does not apply: the engine runs fp16 on CPU)"
        return note
    note = (f"zero_strategy: {dtype} mixed precision inside the ZeRO engine: {dtype} parameters for forward and "
            f"backward, fp32 master weights in the optimizer shards, floating inputs cast at the model's forward{extra}; "
            "no torch.autocast and no GradScaler")
    if fp16 and precision_flag != "16-mixed":
        note += " (Lightning's fallback to bf16 on CPU does not apply: the engine runs fp16 on CPU)"
    return note


class _PrecisionNoteFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            match = _AMP.match(record.getMessage())
            if match:
                strategy = _connector_strategy()
                if type(strategy).__module__.startswith(__package__ + "."):
                    config = getattr(strategy, "config", None)
                    record.msg = precision_note("bf16-mixed" if match.group(1) == "bfloat16" else "16-mixed",
                                                autocast=bool(getattr(config, "autocast", False)))
                    record.args = ()
        except Exception:  # noqa: BLE001 - a log filter must never break logging
            pass
        return True


_FILTER = _PrecisionNoteFilter()


def install_precision_note() -> None:
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
