"""What docs/lightning.md quotes as output is what the documented commands print
(issue #34 item 7).

The quotes are read from the doc itself, so editing a figure there without a run that
prints it, or changing what the example prints without updating the doc, fails here:

* the set-up line (the fenced block that starts with ``ZeRO stage``), exactly, from
  ``.venv/bin/python examples/lightning/finetune_gpt2.py`` (zero3, 2 CPU processes),
  and its GiB figure where the prose below it names it;
* the losses ``train_loss`` / ``val_loss`` after 40 steps, to the digits the doc prints,
  from that run and from the same command with ``ddp`` (the doc says they are ddp's);
* the parameter memory each rank holds and the whole model's size from that run, and
  the figure with ``param_persistence_threshold: 0`` from
  ``examples/lightning/cli.py fit --config examples/lightning/zero3.yaml``.

Each command is launched as the doc says (``python script``: Lightning's launcher starts
the second CPU process).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from test_lightning import _run

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "lightning.md"
EXAMPLE = "examples/lightning/finetune_gpt2.py"


def _doc() -> str:
    return DOC.read_text()


def _one(pattern: str, text: str) -> tuple:
    """The one match of ``pattern`` in ``text`` with its line breaks read as spaces (prose)."""
    found = re.findall(pattern, re.sub(r"\s+", " ", text))
    assert len(found) == 1, f"docs/lightning.md: expected one match of {pattern!r}, found {found}"
    return found[0] if isinstance(found[0], tuple) else (found[0],)


def _setup_lines(doc: str) -> list:
    """Every quoted set-up line: the unlabelled fenced blocks that start with 'ZeRO stage'."""
    found, fence = [], None  # fence: the info string of the open block, None outside blocks
    for line in doc.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "" and line.startswith("ZeRO stage "):
            found.append(line)
    return found


def _quoted_losses(doc: str) -> dict:
    train, val = _one(r"`train_loss` (\d+\.\d+), `val_loss` (\d+\.\d+)", doc)
    return {"train_loss": train, "val_loss": val}


def _printed_metrics(out: str, strategy: str) -> dict:
    """The example's last line on rank 0: ``<strategy> 32-true: {'train_loss': ..., ...}``."""
    lines = [l for l in out.splitlines() if l.startswith(f"{strategy} 32-true: {{")]
    assert len(lines) == 1, out[-3000:]
    return ast.literal_eval(lines[0].split(": ", 1)[1])


def _assert_same_to_quoted_digits(printed: dict, quoted: dict, what: str):
    for key, text in quoted.items():
        digits = len(text.split(".")[1])
        assert f"{printed[key]:.{digits}f}" == text, f"{what}: {key} printed {printed[key]}, docs/lightning.md says {text}"


def test_the_doc_quotes_what_this_test_checks():
    """The quotes exist where the slow tests look for them (runs no process)."""
    doc = _doc()
    assert len(_setup_lines(doc)) == 1
    # the prose under the quoted set-up line names its model-state figure (GiB)
    held_now = re.search(r"model states ([\d.]+) GiB on this rank now", _setup_lines(doc)[0])
    assert held_now, _setup_lines(doc)[0]
    assert _one(r"before gradients and the Adam moments exist, so the ([\d.]+) GiB", doc) == (held_now.group(1),)
    _quoted_losses(doc)
    held_cli, held_name = _one(r"([\d.]+) MiB with threshold 0 against ([\d.]+) MiB with the name alone", doc)
    held, _ = _one(r"prints `parameters: ([\d.]+)` MiB of the whole model's ([\d.]+) MiB", doc)
    assert held_name == held
    assert _one(r"see LightningCLI below, it is ([\d.]+) MiB", doc) == (held_cli,)


@pytest.mark.slow
def test_finetune_example_prints_the_quoted_setup_line_losses_and_memory():
    doc = _doc()
    proc = _run(EXAMPLE)  # zero3, 32-true, 2 CPU processes: the doc's first command
    out = proc.stdout + proc.stderr
    lines = [l.rstrip() for l in out.splitlines()]
    for quoted in _setup_lines(doc):
        assert quoted in lines, f"docs/lightning.md quotes a set-up line this run does not print:\n{quoted}\n" + \
            "\n".join(l for l in lines if l.startswith("ZeRO stage"))
    _assert_same_to_quoted_digits(_printed_metrics(out, "zero3"), _quoted_losses(doc), "zero3")

    held, whole = _one(r"prints `parameters: ([\d.]+)` MiB of the whole model's ([\d.]+) MiB", doc)
    memory = [l for l in lines if re.match(r"\[rank \d\] memory \(MiB\): ", l)]
    assert len(memory) == 2, out[-3000:]
    for line in memory:
        assert f"'parameters': {held}," in line, (line, held)
        assert line.endswith(f"the whole model's parameters: {whole} MiB"), (line, whole)
    assert f"the whole model is {whole} MiB" in re.sub(r"\s+", " ", doc)


@pytest.mark.slow
def test_finetune_example_under_ddp_prints_the_quoted_losses():
    proc = _run(EXAMPLE, "ddp")
    _assert_same_to_quoted_digits(_printed_metrics(proc.stdout + proc.stderr, "ddp"), _quoted_losses(_doc()), "ddp")


@pytest.mark.slow
def test_cli_example_with_threshold_0_holds_the_quoted_parameter_memory():
    held_cli, _ = _one(r"([\d.]+) MiB with threshold 0 against ([\d.]+) MiB with the name alone", _doc())
    proc = _run("examples/lightning/cli.py", "fit", "--config", "examples/lightning/zero3.yaml")
    out = proc.stdout + proc.stderr
    found = re.findall(r"\[rank (\d)\] stage 3, param_persistence_threshold 0: parameters held ([\d.]+) MiB", out)
    assert sorted(found) == [("0", held_cli), ("1", held_cli)], (found, held_cli, out[-3000:])
