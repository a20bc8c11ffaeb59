"""benchmarks/gpu_check: the GPU check's whole code path rehearsed on CPU with tiny shapes
(--device cpu --tiny), so the one-shot run on a lent GPU does not fail on a bug
reachable here. Figures are checked against references outside the script: GPT-2's and
Llama's parameter counts from their shapes, the paper's per-rank formulas, MFU's
definition, and plain PyTorch's losses on the same batch."""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")


def _gpu_check():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import gpu_check

    return gpu_check


def _gpt2_params(n_layer, n_embd, vocab_size, n_positions, **_):
    # Per block: qkv (3h² + 3h), proj (h² + h), fc (4h² + 4h), fc-proj (4h² + h), two LayerNorms (4h).
    h = n_embd
    return n_layer * (12 * h * h + 13 * h) + vocab_size * h + n_positions * h + 2 * h  # tied head, ln_f


def _llama_params(hidden_size, intermediate_size, num_hidden_layers, vocab_size, **_):
    h, i = hidden_size, intermediate_size  # as many KV heads as heads in the tiny shape
    return num_hidden_layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab_size * h + h  # untied head, final norm


def _paper_bytes(psi, n, stage):
    shard = -(-psi // n)
    return {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]


def test_tiny_cpu_rehearsal_reports_every_part(tmp_path):
    gpu_check = _gpu_check()
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--no-isolate", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    page = (out / "gpu_check.md").read_text()
    for heading in ("## Step time, MFU", "## Peak memory of one rank", "## Activation checkpointing", "## Optimizer offload"):
        assert heading in page
    parts = report["parts"]
    assert list(parts) == ["stages", "activations", "memory_at_n", "offload"]
    for name, part in parts.items():
        assert part["status"] == "ok" and "error" not in part, (name, part.get("error"))
    shapes = report["shapes"]
    psi = _gpt2_params(**shapes["gpt"])
    tokens = shapes["batch"] * shapes["seq"]

    # (a, b, c) plain PyTorch and every stage, world size 1.
    stages = parts["stages"]
    names = ["torch_amp", "torch_bf16", "zero0", "zero1", "zero2", "zero3", "zero3_thr0"]
    for name in names:
        r = stages[name]
        assert "error" not in r, (name, r["error"])
        assert r["psi"] == psi and r["tokens_per_step"] == tokens
        assert r["mfu"] == pytest.approx(6 * psi * tokens / r["step_s"] / 989e12)
        assert r["estimate_formula"] == 16 * psi  # every stage is 16Ψ at N = 1
        assert r["peak_bytes"] > 0 and r["model_state_bytes"] > 0
    reference = stages["torch_amp"]["losses"]
    assert reference[-1] < reference[0]  # the same batch every step: it learns
    for name in names[2:]:
        # bf16 compute on fp32 masters: the same arithmetic as autocast over fp32 parameters.
        assert max(abs(a - b) for a, b in zip(stages[name]["losses"], reference)) < 2e-3, name
    assert stages["zero3"]["vs_torch_amp"] == pytest.approx(stages["zero3"]["step_s"] / stages["torch_amp"]["step_s"])

    # (c) one rank of N (fake process group): the paper's per-stage formulas.
    at_n = parts["memory_at_n"]
    n = at_n["world_size"]
    assert n > 1
    for name, stage in (("zero0", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_thr0", 3)):
        assert at_n[name]["estimate_formula"] == _paper_bytes(psi, n, stage), name
    states = {k: at_n[k]["model_state_bytes"] for k in ("zero0", "zero1", "zero2", "zero3_thr0")}
    assert states["zero0"] == pytest.approx(16 * psi, rel=0.01)
    assert states["zero1"] == pytest.approx(_paper_bytes(psi, n, 1), rel=0.01)
    # Fully partitioned stage 3 between steps: the fp32 master and Adam's moments (12Ψ/N);
    # no 16-bit shard is kept and the gradient shard is freed after the step.
    assert states["zero3_thr0"] == pytest.approx(12 * psi / n, rel=0.02)
    assert states["zero0"] > states["zero1"] > states["zero2"] > states["zero3_thr0"]

    # (e) activation checkpointing (and its offload) recomputes exactly: same losses.
    acts = parts["activations"]
    for stage in (2, 3):
        plain = acts[f"stage{stage}_none"]["losses"]
        for label in ("checkpointing", "checkpointing+offload"):
            row = acts[f"stage{stage}_{label}"]
            assert "error" not in row, row["error"]
            assert row["losses"] == pytest.approx(plain, abs=1e-5), (stage, label)

    # (d) optimizer offload: two steps; in host memory the fp32 master, the fp32 gradient
    # shard and Adam's moments (16Ψ/N, docs/bigger-models.md).
    off = parts["offload"]
    lpsi = _llama_params(**shapes["llama"])
    assert off["model"]["psi"] == lpsi
    assert [s["step"] for s in off["steps"]] == [1, 2, 3]
    # the fused host step, then the optimizer's own (before/after on one engine)
    assert [s["host_optimizer_step"] for s in off["steps"]] == ["fused", "fused", "optimizer"]
    host = off["steps"][-1]["memory_report"]["host"]
    assert host == pytest.approx(16 * lpsi, rel=0.01)
    assert off["steps"][1]["loss"] < off["steps"][0]["loss"]


@pytest.mark.slow
def test_gpu_check_script_runs_a_part_in_its_own_process(tmp_path):
    """benchmarks/gpu_check.sh as the GPU machine runs it (python chosen, tests/core/test_gpu.py
    run and skipped, a part in a subprocess), one part, on CPU."""
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh"), "--device", "cpu", "--tiny", "--parts", "offload"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["isolated"] and report["tests"]["rc"] == "0", report["tests"]
    assert "skipped" in report["tests"]["tail"]  # no CUDA device here
    part = report["parts"]["offload"]
    assert part["status"] == "ok" and "error" not in part and len(part["steps"]) == 3
    assert "## Optimizer offload" in proc.stdout


def test_a_failing_configuration_or_part_leaves_the_rest_reported(tmp_path, monkeypatch):
    """One configuration raising (zero1), one whole part raising (offload) and a part with
    no time left: each is reported as such and everything else still runs."""
    gpu_check = _gpu_check()
    import gpu_check_parts

    real = gpu_check_parts.make_system

    def make_system(name, shapes, device):
        if name == "zero1":
            raise RuntimeError("injected: CUDA out of memory")
        return real(name, shapes, device)

    def offload(ctx, record):
        record("model", {"psi": 1})
        raise MemoryError("injected: host memory")

    monkeypatch.setattr(gpu_check_parts, "make_system", make_system)
    monkeypatch.setitem(gpu_check_parts.PARTS, "offload", offload)
    out = tmp_path / "out"
    gpu_check.main(["--device", "cpu", "--tiny", "--no-isolate", "--parts", "memory_at_n,offload", "--out", str(out)])
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    at_n = parts["memory_at_n"]
    assert "injected: CUDA out of memory" in at_n["zero1"]["error"]
    for name in ("zero0", "zero2", "zero3", "zero3_thr0"):
        assert "error" not in at_n[name] and at_n[name]["model_state_bytes"] > 0, name
    assert "injected: host memory" in parts["offload"]["error"] and parts["offload"]["model"] == {"psi": 1}
    page = (out / "gpu_check.md").read_text()
    assert "zero1: RuntimeError: injected" in page and "MemoryError: injected" in page

    gpu_check.main(["--device", "cpu", "--tiny", "--no-isolate", "--budget", "0", "--out", str(out)])
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert all(p["status"].startswith("not run") for p in parts.values()) and len(parts) == 4


def test_builtin_models_stand_in_for_transformers(tmp_path):
    """Where the GPU machine's Python lacks transformers, the check uses pure-torch models
    with the same parameter shapes: counts equal transformers' own models, and the check runs
    (stage systems against plain PyTorch, optimizer offload of the deferred-init Llama)."""
    gpu_check = _gpu_check()
    import gpu_check_models as models
    import gpu_check_parts as parts
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def shapes_of(model):
        # Transpose-blind: GPT-2's Conv1D stores its weight as (in, out), nn.Linear as (out, in).
        return sorted(tuple(sorted(p.shape)) for p in model.parameters())

    gpt = dict(parts.GPT_TINY)
    assert shapes_of(models.GPT(**gpt)) == shapes_of(GPT2LMHeadModel(GPT2Config(**gpt)))
    for kv_heads in (4, 2):  # and grouped-query attention, as the 70B's
        llama = dict(parts.LLAMA_TINY, num_key_value_heads=kv_heads)
        ours = models.Llama(models.llama_config(llama, "builtin"))
        assert shapes_of(ours) == shapes_of(LlamaForCausalLM(LlamaConfig(**llama, tie_word_embeddings=False)))
        ids = torch.randint(0, llama["vocab_size"], (2, 16))
        ours(input_ids=ids, labels=ids).loss.backward()

    out = tmp_path / "out"
    gpu_check.main(["--device", "cpu", "--tiny", "--no-isolate", "--repeats", "1", "--models", "builtin",
                    "--parts", "stages,offload", "--out", str(out)])
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["models"].startswith("built-in")
    stages = report["parts"]["stages"]
    for name in ("torch_amp", "zero0", "zero2", "zero3_thr0"):
        assert "error" not in stages[name], stages[name]["error"]
        assert stages[name]["psi"] == _gpt2_params(**report["shapes"]["gpt"])
        assert max(abs(a - b) for a, b in zip(stages[name]["losses"], stages["torch_amp"]["losses"])) < 2e-3, name
    off = report["parts"]["offload"]
    assert "error" not in off, off.get("error")
    assert off["model"]["psi"] == _llama_params(**report["shapes"]["llama"]) and len(off["steps"]) == 3


def test_offload_host_memory_plan_for_the_7b():
    """The 7B part's host-memory plan: 16Ψ without the pinned allocator's rounding (fp32
    master + fp32 gradient shard + Adam's moments, docs/bigger-models.md), more with it, and
    the layer count shrinks to what fits."""
    _gpu_check()
    import gpu_check_parts as parts
    from transformers import LlamaConfig

    cfg = LlamaConfig(**parts.LLAMA_7B)
    layer, root = parts.llama_layer_numel(cfg), 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    psi = _llama_params(**parts.LLAMA_7B)
    assert 32 * layer + root == psi
    units = [layer] * 32 + [root]
    assert parts.host_bytes_needed(units, rounds_pinned=False) == 16 * psi
    # Rounded: every unit's two 4n-byte pinned blocks (0.81 GB a layer, 1.05 GB the embedding
    # and head) become 2^30 bytes each.
    assert parts.host_bytes_needed(units, rounds_pinned=True) == 33 * 2 * 2**30 + 8 * psi
    assert parts.layers_that_fit(layer, root, 32, 16 * psi, rounds_pinned=False) == 32
    assert parts.layers_that_fit(layer, root, 32, 16 * psi - 1, rounds_pinned=False) == 31
    assert parts.layers_that_fit(layer, root, 32, 16 * psi, rounds_pinned=True) < 32
    assert parts.layers_that_fit(layer, root, 32, 0, rounds_pinned=False) == 1
