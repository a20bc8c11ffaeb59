"""What the user reads when building a Trainer/Fabric with a ZeRO strategy (#14 items 8, 9):
a mistyped strategy name lists the ZeRO names, and Lightning's "Automatic Mixed Precision
(AMP)" line, untrue under ZeRO (no autocast), is replaced.  Fresh interpreters: the names
come from the start-up hook, as for a user's script.
"""
from __future__ import annotations

import json
import textwrap

from test_lightning import _run

_TRY_NAMES = """
    import json, sys
    import lightning.pytorch as pl
    import pytorch_lightning
    from lightning.fabric import Fabric
    out = {}
    for name in ("zero_3", "zero4", "Zero-2", "zer3", "dpp", "zero3"):
        for kind, build in (("trainer", pl.Trainer), ("fabric", Fabric), ("pytorch_lightning", pytorch_lightning.Trainer)):
            try:
                build(strategy=name, accelerator="cpu", devices=2)
                out[f"{kind}:{name}"] = None
            except ValueError as e:
                out[f"{kind}:{name}"] = str(e)
    print("RESULT" + json.dumps(out))
"""


def _result(proc):
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_mistyped_strategy_name_lists_the_zero_names():
    got = _result(_run("-c", textwrap.dedent(_TRY_NAMES)))
    for kind in ("trainer", "fabric", "pytorch_lightning"):
        assert got[f"{kind}:zero3"] is None  # the real name still works
        # A name that is not ours keeps Lightning's own message, word for word.
        assert got[f"{kind}:dpp"].startswith("You selected an invalid strategy name: `strategy='dpp'`. It must be"), got
        for typo, hint in (("zero_3", "Did you mean 'zero3'?"), ("zer3", "Did you mean 'zero3'?"),
                           ("Zero-2", "Did you mean 'zero2'?"), ("zero4", "there is no stage 4")):
            message = got[f"{kind}:{typo}"]
            assert message and message.startswith("You selected an invalid strategy name"), (kind, typo, message)
            assert hint in message, (kind, typo, message)
            for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
                assert f"{name} (ZeRO stage" in message, (kind, typo, message)


_BUILD = """
    import sys
    import lightning.pytorch as pl
    import pytorch_lightning
    from lightning.fabric import Fabric
    for strategy in ("ddp", "zero2"):
        for precision in ("bf16-mixed", "16-mixed"):
            print(f"CASE {strategy} {precision}", file=sys.stderr, flush=True)
            pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, logger=False)
            print(f"CASE fabric-{strategy} {precision}", file=sys.stderr, flush=True)
            Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)
            print(f"CASE pl-{strategy} {precision}", file=sys.stderr, flush=True)
            pytorch_lightning.Trainer(strategy=strategy, accelerator="cpu", devices=2, precision=precision, logger=False)
"""


def test_precision_message_says_what_runs():
    """ddp prints Lightning's AMP line (so the capture works); under ZeRO that line is
    replaced by what the engine does, fp16 included where Lightning falls back to bf16 on CPU."""
    proc = _run("-c", textwrap.dedent(_BUILD))
    text = proc.stderr  # the markers and Lightning's log lines, in order
    cases = {}
    for line in text.splitlines():
        if line.startswith("CASE "):
            current = cases.setdefault(line[5:], [])
        elif "Automatic Mixed Precision" in line or line.startswith("zero_strategy:"):
            current.append(line)
    for prefix in ("", "fabric-", "pl-"):
        assert cases[f"{prefix}ddp bf16-mixed"] == ["Using bfloat16 Automatic Mixed Precision (AMP)"], cases
        for precision, dtype in (("bf16-mixed", "bf16"), ("16-mixed", "fp16")):
            lines = cases[f"{prefix}zero2 {precision}"]
            assert len(lines) == 1 and lines[0].startswith(f"zero_strategy: {dtype} mixed precision inside the ZeRO engine"), lines
            assert "no torch.autocast" in lines[0]
