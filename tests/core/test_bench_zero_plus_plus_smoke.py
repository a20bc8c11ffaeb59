"""benchmarks/ ZeRO++ scripts: the simulation with tiny arguments, checked against its own
formulas and the engine's accounting function, never against numbers from a run.

* the Llama parameter count the simulation uses equals transformers' model's;
* splitting per-kind (intra, cross) bytes back into collectives by level, then
  re-applying ``topology.sent_bytes``, gives the same bytes (the ``--check`` path);
* at every node count and bandwidth: compute is 6ΨT / (MFU x peak), step times are
  compute + communication (no overlap) and their maximum (full overlap), NIC bytes
  follow the ring formula per level, hpZ sends no more across nodes than plain stage 3,
  hpZ + qwZ + qgZ no more than hpZ or HSDP, faster NICs never slow a step;
* a measurement file in bench_cross_node's format drives the same numbers as the
  design's nominal bytes it was made from, and the page renders from it (plots in Agg);
* the loss-curve comparison puts a run inside / outside the seed band as constructed.
"""
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import simulate_zero_plus_plus as Z  # noqa: E402

TINY = ["--models", "7b", "--nodes", "2,4", "--nic-gbps", "100,400", "--measured", "nominal"]


def _sent(ops, psi, nodes, per_node):
    """Per kind (intra, cross) bytes per rank of these ops, by the engine's own function."""
    from zero_strategy.communication.topology import GroupPlacement, Topology, sent_bytes

    topo = Topology(nodes * per_node, per_node)
    groups = {"flat": list(range(nodes * per_node)), "node": topo.node_ranks(0), "cross": topo.peers_across(0)}
    kinds = {}
    for o in ops:
        # cross ops' bytes per parameter refer to L0 = 1 in the nominal set: at L0 = per_node they carry 1/L0
        s = o["bytes_per_param"] * psi / (per_node if o["level"] == "cross" else 1)
        a, c = sent_bytes("all_reduce" if o["m"] == 2 else "all_gather", s,
                          GroupPlacement.of(topo, groups[o["level"]], 0))
        k = kinds.setdefault(o["kind"], {"intra_node_bytes": 0, "cross_node_bytes": 0, "elements": 1, "bytes": 1})
        k["intra_node_bytes"] += a
        k["cross_node_bytes"] += c
    return kinds


@pytest.mark.slow  # importing transformers: seconds
def test_llama_parameter_count_matches_transformers():
    transformers = pytest.importorskip("transformers")
    import torch

    for shape in (dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=100),
                  dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=77)):  # GQA as the 70B shape
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
        assert Z.llama_params(shape) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4), (4, 2), (3, 8)])
def test_decomposition_gives_the_accounted_bytes_back(nodes, per_node):
    psi = 1_000_000
    for system, ops in Z.nominal_ops().items():
        kinds = _sent(ops, psi, nodes, per_node)
        row = {"psi": psi, "kinds_rank0": kinds}
        got = Z.ops_from_measurement(row, nodes, per_node)
        want = {(o["kind"], o["level"]): o["bytes_per_param"] / (per_node if o["level"] == "cross" else 1)
                for o in ops}
        assert {(o["kind"], o["level"]) for o in got} == set(want), system
        for o in got:
            assert o["bytes_per_param"] == pytest.approx(want[(o["kind"], o["level"])], abs=1e-5), system
        intra, cross = Z.reapply(got, psi, nodes, per_node)
        assert intra == pytest.approx(sum(k["intra_node_bytes"] for k in kinds.values()), abs=len(got) + 1)
        assert cross == pytest.approx(sum(k["cross_node_bytes"] for k in kinds.values()), abs=len(got) + 1)


def test_simulation_follows_its_formulas():
    args = Z.parse_args(TINY)
    out = Z.run(args)
    rows = out["rows"]
    assert len(rows) == len(args.models) * len(args.nodes) * len(args.nic_gbps) * len(args.systems)
    psi = Z.llama_params(Z.model_shapes()["7b"])
    q8, q4, b = 1 + 4 / 256, 0.5 + 4 / 256, 2.0
    L = args.gpus_per_node
    by = {(r["system"], r["nodes"], r["nic_gbps"]): r for r in rows}
    for r in rows:
        M = r["nodes"]
        assert r["compute_s"] == pytest.approx(6 * psi * args.tokens_per_gpu / (args.mfu * args.peak_tflops * 1e12))
        assert r["comm_s"] == pytest.approx(r["nvlink_s"] + r["nic_s"])
        assert r["step_no_overlap_s"] == pytest.approx(r["compute_s"] + r["comm_s"])
        assert r["step_full_overlap_s"] == pytest.approx(max(r["compute_s"], r["comm_s"]))
        assert r["nic_s"] == pytest.approx(r["nic_bytes"] / (r["nic_gbps"] * 1e9 / 8))
        assert r["nvlink_s"] == pytest.approx(r["nvlink_bytes"] / (args.nvlink_gbs * 1e9))
        # ring formula per level: flat ops put S/L per GPU across, cross ops their 1/L-sized tensor
        across = (M - 1) / M / L * psi
        expected_nic = {"zero3": 3 * b, "zero3_hpz": 2 * b, "zero3_zpp": q8 + q4, "fsdp2_hsdp": 2 * b}[r["system"]]
        assert r["nic_bytes"] == pytest.approx(expected_nic * across)
        # every op moves S (L-1)/L over NVLink except the cross ones
        inside = {"zero3": 3 * b, "zero3_hpz": 3 * b, "zero3_zpp": q8 + 2 * b, "fsdp2_hsdp": 3 * b}[r["system"]]
        assert r["nvlink_bytes"] == pytest.approx(inside * psi * (L - 1) / L)
        states = {"zero3": 16 * psi / (M * L), "fsdp2_hsdp": 16 * psi / L}.get(r["system"], 16 * psi / (M * L) + 2 * psi / L)
        assert r["model_state_bytes"] == pytest.approx(states)
    for M in args.nodes:
        for g in args.nic_gbps:
            plain, hpz, zpp, hsdp = (by[(s, M, g)] for s in ("zero3", "zero3_hpz", "zero3_zpp", "fsdp2_hsdp"))
            assert hpz["nic_bytes"] <= plain["nic_bytes"]
            assert zpp["nic_bytes"] <= min(hpz["nic_bytes"], hsdp["nic_bytes"])
            assert zpp["nic_bytes"] <= 0.26 * plain["nic_bytes"]  # (8.125 + 4.125) / 48 bits
            assert zpp["step_no_overlap_s"] <= plain["step_no_overlap_s"]
        for s in args.systems:
            slow, fast = by[(s, M, min(args.nic_gbps))], by[(s, M, max(args.nic_gbps))]
            assert fast["step_no_overlap_s"] <= slow["step_no_overlap_s"]
            assert fast["nvlink_s"] == pytest.approx(slow["nvlink_s"])
    text = Z.markdown(rows, args, out["source"])
    assert text.count("| 2 | 100 |") == 1 and "plain stage 3" in text


def _fake_measurement(psi, nodes, per_node):
    """bench_cross_node's JSON for the nominal ops, as its summarize() lays it out."""
    rows = []
    for system, ops in Z.nominal_ops().items():
        kinds = _sent(ops, psi, nodes, per_node)
        for k in kinds.values():
            k.update(calls=1, elements=psi, bytes=psi * 2, bits_per_element=16.0, elements_per_psi=1.0)
        cross = sum(k["cross_node_bytes"] for k in kinds.values())
        intra = sum(k["intra_node_bytes"] for k in kinds.values())
        rows.append({"system": system, "label": system, "config": {}, "psi": psi, "cross_node_bytes": cross,
                     "intra_node_bytes": intra, "steps_equal": True, "kinds_rank0": kinds, "steps_per_s": 1.0,
                     "losses_rank0": [1.0]})
    plain = rows[0]
    for r in rows:
        r["cross_vs_plain"] = r["cross_node_bytes"] / plain["cross_node_bytes"]
        r["intra_vs_plain"] = r["intra_node_bytes"] / plain["intra_node_bytes"]
    import bench_cross_node as X

    config = {"model": "fake", "precision": "bf16", "psi": psi, "n_layer": 1, "n_embd": 8, "n_head": 1, "vocab": 16,
              "seq": 8, "micro_batch": 1, "rows": rows}
    config["targets"] = X.check_targets(rows)
    return {"command": "benchmarks/bench_cross_node.py --fake", "nodes": nodes, "ranks_per_node": per_node,
            "world_size": nodes * per_node, "steps": 1, "warmup": 1, "threads_per_rank": 1, "torch": "x",
            "date": "today", "cores": 2, "loadavg_before": [0, 0, 0], "loadavg_after": [0, 0, 0], "wall_s": 1.0,
            "configs": [config]}


def _fake_losses(steps=60):
    import zero_plus_plus_loss as LS

    base = [3.0 + 2.0 * math.exp(-i / 10) for i in range(steps)]
    runs = [{"name": "plain", "seed": s, "config": {}, "loss": [v + 0.02 * s for v in base],
             "val": [(0, 5.0 + 0.02 * s), (steps, 3.0 + 0.02 * s)], "median_step_s": 1.0} for s in range(3)]
    runs.append({"name": "quantized", "seed": 0, "config": {}, "loss": [v + 0.01 for v in base],
                 "val": [(0, 5.01), (steps, 3.01)], "median_step_s": 1.2})
    summary = {"command": "benchmarks/zero_plus_plus_loss.py --fake", "model": "25m", "precision": "bf16",
               "psi": 25_000_000, "steps": steps, "micro_batch": 4, "seq": 64, "lr": 1e-3, "nodes": 2,
               "ranks_per_node": 2, "world_size": 4, "tokens_per_step": 1024, "corpus_bytes": 4e6,
               "val_windows": 32, "eval_every": 25, "smooth": 5, "wall_s": 60.0, "loadavg_before": [1, 1, 1],
               "loadavg_after": [1, 1, 1], "runs": runs}
    summary["comparison"] = LS.compare(summary)
    return summary


def test_loss_comparison_band():
    c = _fake_losses()["comparison"]
    (q,) = c["quantized"]
    assert q["final_within_plain_range"] and q["steps_smoothed_in_band"] == q["steps"] == 60
    assert q["position"] == "inside"
    assert q["final_minus_same_seed_plain"] == pytest.approx(0.01)
    assert c["plain_final_spread"] == pytest.approx(0.04)
    outside = _fake_losses()
    outside["runs"][-1]["loss"] = [v + 0.5 for v in outside["runs"][-1]["loss"]]
    import zero_plus_plus_loss as LS

    (q,) = LS.compare(outside)["quantized"]
    assert not q["final_within_plain_range"] and q["steps_smoothed_in_band"] == 0 and q["position"] == "above"


def test_appending_runs_needs_the_same_settings(tmp_path):
    import zero_plus_plus_loss as LS

    first = _fake_losses()
    for k in ("date", "torch"):
        first[k] = "x"
    path = tmp_path / "loss.json"
    path.write_text(json.dumps(first))
    more = json.loads(json.dumps(first))
    more["runs"] = [dict(first["runs"][-1], seed=1), dict(first["runs"][-1], seed=2)]
    more["command"] = "benchmarks/zero_plus_plus_loss.py --seeds '' --quantized-seeds 1,2 --append"
    merged = LS.appended(str(path), more)
    assert [(r["name"], r["seed"]) for r in merged["runs"]] == [("plain", 0), ("plain", 1), ("plain", 2),
                                                               ("quantized", 0), ("quantized", 1), ("quantized", 2)]
    assert len(merged["commands"]) == 2 and merged["wall_s"] == 2 * first["wall_s"]
    assert len(merged["comparison"]["quantized_final"]) == 3
    more["steps"] = 61
    with pytest.raises(SystemExit):
        LS.appended(str(path), more)


@pytest.mark.slow  # matplotlib and two figures: seconds
def test_measurement_file_drives_the_simulation_and_the_page(tmp_path):
    pytest.importorskip("matplotlib")
    data = tmp_path / "zero_plus_plus"
    data.mkdir()
    with open(data / "cross_node.json", "w") as f:
        json.dump(_fake_measurement(2_000_000, 2, 2), f)
    with open(data / "loss_curves.json", "w") as f:
        json.dump(_fake_losses(), f)
    measured = Z.run(Z.parse_args(TINY[:-2] + ["--measured", str(data / "cross_node.json"), "--check"]))
    nominal = Z.run(Z.parse_args(TINY))
    for a, b in zip(measured["rows"], nominal["rows"]):
        assert (a["system"], a["nodes"], a["nic_gbps"]) == (b["system"], b["nodes"], b["nic_gbps"])
        assert a["step_no_overlap_s"] == pytest.approx(b["step_no_overlap_s"], rel=1e-6)
    for c in measured["checks"]:
        assert c["cross"] == pytest.approx(c["measured_cross"], abs=8)
        assert c["intra"] == pytest.approx(c["measured_intra"], abs=8)

    import zero_plus_plus_page as P

    page = P.render(str(data), str(tmp_path / "zero_plus_plus.md"))
    text = open(page).read()
    for heading in ("## Measured: cross-node bytes", "## Measured: loss curves", "## Simulated: step time"):
        assert heading in text
    assert (data / "loss_curves.png").stat().st_size > 0
    assert (data / "simulated_step_time.png").stat().st_size > 0
    assert "{rel}/zero_plus_plus.md" in (data / "summary.md").read_text()


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 8)])
def test_nominal_bytes_agree_with_the_engines_traffic_estimate(nodes, per_node):
    """The design's bytes, counted by sent_bytes, equal zero_strategy.estimate_traffic's
    cross-node bytes (two implementations of the same accounting)."""
    from zero_strategy.estimate_traffic import step_traffic

    psi = 1 << 24
    options = {"zero3": {}, "zero3_hpz": {"secondary_partition": True},
               "zero3_zpp": {"secondary_partition": True, "weight_bits": 8, "gradient_bits": 4}}
    for system, kwargs in options.items():
        ops = [dict(o, bytes_per_param=o["bytes_per_param"] / (per_node if o["level"] == "cross" else 1))
               for o in Z.nominal_ops()[system]]
        _, cross = Z.reapply(ops, psi, nodes, per_node)
        want = step_traffic(psi, nodes * per_node, per_node, 3, "bf16", **kwargs)
        assert cross == pytest.approx(want.cross_node, rel=1e-6), system
