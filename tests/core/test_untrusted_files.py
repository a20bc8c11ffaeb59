"""Files we read can be planted by someone else: reading them must never run code,
never read outside their folder, and never assign attributes a file names.

The malicious file is a real pickle whose unpickling would create a marker file; each
test asserts the refusal (on every rank) and that the marker was never created."""
from __future__ import annotations

import fractions
import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed
from models import lm_batches
from parity import build


class _Planted:
    """Unpickling this calls ``open(marker, "w")``: the file appears iff code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_client_state(checkpoint_dir: Path, marker: Path) -> None:
    torch.save({"epoch": 1, "payload": _Planted(str(marker))}, Path(checkpoint_dir) / "client_state.pt")


def _save_and_reload_worker(rank, ws, path, marker, client_state, weights_only, tamper):
    import zero_strategy
    from zero_strategy import CheckpointError
    from zero_strategy.checkpoint.manifest import seal

    model, opt = build(dict(optim="adamw"))
    engine = zero_strategy.initialize(model, opt, dict(stage=3, param_persistence_threshold=0))
    ids = lm_batches(1, 4)[0].view(ws, -1, 16)[rank]
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(path, client_state=client_state)
    before = engine.full_state_dict(rank0_only=False)
    torch.distributed.barrier()
    if rank == 0:
        if tamper == "plant":
            plant_client_state(Path(path), Path(marker))
        elif tamper is not None:
            manifest = Path(path) / "manifest.json"
            m = json.loads(manifest.read_text())
            m["loss_scaler"] = tamper
            # resealed, as a deliberate editor would: the entry's own validation must refuse it
            manifest.write_text(json.dumps(seal(m)))
    torch.distributed.barrier()
    try:
        client = engine.load_checkpoint(path, weights_only=weights_only)
    except CheckpointError as e:
        after = engine.full_state_dict(rank0_only=False)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        return {"error": str(e), "unchanged": unchanged}
    return {"client": client}


@pytest.mark.slow
@pytest.mark.parametrize("weights_only", [True, None])
def test_planted_client_state_is_refused_on_every_rank_and_runs_nothing(tmp_path, weights_only):
    marker = tmp_path / "marker"
    results = run_distributed(_save_and_reload_worker, 2, str(tmp_path / "ck"), str(marker), {"epoch": 1}, weights_only, "plant")
    for r in results:
        assert "error" in r, r
        assert "client_state.pt" in r["error"] and "weights_only=False" in r["error"], r["error"]
        assert r["unchanged"], "a refused checkpoint changed the model"
    assert not marker.exists(), "unpickling the planted file ran code"


@pytest.mark.slow
def test_weights_only_false_is_an_explicit_opt_in_for_trusted_state(tmp_path):
    """A harmless non-tensor object (a Fraction) is refused by default and loads when the
    caller says it trusts the file."""
    state = {"ratio": fractions.Fraction(1, 3)}
    refused = run_distributed(_save_and_reload_worker, 2, str(tmp_path / "a"), "", state, True, None)
    assert all("weights_only=False" in r.get("error", "") for r in refused), refused
    loaded = run_distributed(_save_and_reload_worker, 2, str(tmp_path / "b"), "", state, False, None)
    assert [r["client"] for r in loaded] == [state, state]


@pytest.mark.slow
@pytest.mark.parametrize("scaler", [{"__class__": "x"}, {"scale": "os.system"}, {"scale": -1.0}, "scale"])
def test_manifest_loss_scaler_entries_are_validated_not_setattrd(tmp_path, scaler):
    results = run_distributed(_save_and_reload_worker, 2, str(tmp_path / "ck"), "", None, True, scaler)
    for r in results:
        assert "error" in r and "loss_scaler" in r["error"], r
        assert r["unchanged"]


def test_consolidating_a_planted_lightning_checkpoint_runs_nothing(tmp_path):
    """The Lightning consolidation tool reads client_state.pt too: refused by default,
    both from Python and from its command line."""
    import subprocess
    import sys

    from zero_strategy.integrations.lightning.consolidate import consolidate_checkpoint
    from zero_strategy import CheckpointError

    ck = tmp_path / "ck"
    ck.mkdir()
    marker = tmp_path / "marker"
    plant_client_state(ck, marker)
    with pytest.raises(CheckpointError, match="weights_only=False"):
        consolidate_checkpoint(ck)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "zero_strategy.integrations.lightning.consolidate", str(ck), str(tmp_path / "out.ckpt")],
                          cwd=root, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "ZERO_STRATEGY_AUTOLOAD": "0"})
    assert proc.returncode != 0 and "weights_only" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def test_weight_index_entries_cannot_point_outside_the_folder(tmp_path):
    """A model folder's safetensors index is data: ``../outside/x.safetensors`` or an
    absolute path is refused before any file is opened."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_strategy

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "model")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(tmp_path / "model" / "model.safetensors"), outside / "x.safetensors")
    from safetensors import safe_open

    with safe_open(str(outside / "x.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    for target in ("../outside/x.safetensors", str(outside / "x.safetensors")):
        (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in keys}}))
        with zero_strategy.init_context():
            model = GPT2LMHeadModel(cfg)
        with pytest.raises(ValueError, match="outside|only a file inside"):
            zero_strategy.initialize(model, None, dict(stage=3, param_persistence_threshold=0), pretrained=tmp_path / "model")
    # The same index pointing inside the folder loads.
    shutil.move(str(outside / "x.safetensors"), tmp_path / "model" / "w.safetensors")
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "w.safetensors" for k in keys}}))
    with zero_strategy.init_context():
        model = GPT2LMHeadModel(cfg)
    zero_strategy.initialize(model, None, dict(stage=3, param_persistence_threshold=0), pretrained=tmp_path / "model")
