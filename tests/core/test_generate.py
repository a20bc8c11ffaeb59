"""Stage 3 generate(): the model kept gathered for the call (engine.keep_gathered(),
ZeroConfig.keep_gathered_methods / keep_gathered_max_bytes), checked against a plain
single-process copy of the same model: its greedy tokens, and its values after training.

Every stage-3 engine here uses param_persistence_threshold=0, so every parameter is
partitioned (a model this small would otherwise be kept whole)."""
import copy
import inspect
import warnings

import pytest
import torch

from dist_harness import run_distributed

NEW_TOKENS = 6
LR = 2.0  # large enough that one SGD step changes the greedy tokens (asserted below)


def tiny_llama(seed: int = 0):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def greedy(model, prompts, synced_gpus=False, new_tokens=NEW_TOKENS):
    kwargs = {} if synced_gpus is None else {"synced_gpus": synced_gpus}  # None: generate() decides
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, **kwargs)


def counting_all_reduces(fn):
    """``fn()`` and how many torch.distributed.all_reduce calls it made (generate()'s
    lockstep, synced_gpus, is one per new token)."""
    import torch.distributed as dist

    calls, original = [0], dist.all_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        return fn(), calls[0]
    finally:
        dist.all_reduce = original


def prompts():
    return torch.tensor([[5, 17, 33, 2, 71], [9, 9, 40, 60, 3]])


def train_batch(step: int, world_size: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, 96, (2 * world_size, 12), generator=g)


def reference_step(model, batch, world_size: int) -> None:
    """Plain torch on the whole global batch: each rank's micro-batch loss, averaged over
    ranks (the engine averages the gradients), then SGD."""
    model.zero_grad()
    loss = sum(model(input_ids=b, labels=b).loss for b in batch.chunk(world_size)) / world_size
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad


def loss_through_lm_head_weight(model, batch):
    hidden = model(input_ids=batch, output_hidden_states=True).hidden_states[-1]
    logits = hidden @ model.lm_head.weight.T
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def engine_step(engine, model, batch, rank: int, world_size: int) -> None:
    mine = batch.chunk(world_size)[rank]
    engine.backward(model(input_ids=mine, labels=mine).loss)
    engine.step()


def stage3(model, **extra):
    import zero_strategy

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # One gather per decoder layer (min_gather_numel=0): this tiny model would otherwise be a
    # single gather, and the counts below would not tell per-unit from per-call gathering.
    config = dict(stage=3, param_persistence_threshold=0, min_gather_numel=0)
    config.update(extra)
    return zero_strategy.initialize(model, optimizer, config)


def partitioned_units(engine) -> int:
    return sum(1 for u in engine.units if not u.keep_full)


# -- one process (world size 1: every parameter still partitioned and gathered) -----------------
def test_generate_runs_kept_gathered_and_the_wrapper_is_transparent():
    import zero_strategy

    ref, model, off_model = tiny_llama(), tiny_llama(), tiny_llama()
    expected = greedy(ref, prompts())
    engine = stage3(model)
    off = stage3(off_model, keep_gathered_methods=[])
    n = partitioned_units(engine)
    assert n > 1
    sharded = engine.memory_report()["parameters"]
    # The wrapper keeps what tools read from the method: name, docstring, signature.
    assert model.generate.__name__ == "generate" and model.generate.__doc__ == ref.generate.__doc__
    assert inspect.signature(model.generate) == inspect.signature(ref.generate)
    assert model.generate.__self__ is model and model.generate.__func__ is type(model).generate
    assert "generate" not in off_model.__dict__

    for e, m, gathers in ((engine, model, n), (off, off_model, n * NEW_TOKENS)):
        e.reset_comm_report()
        assert torch.equal(greedy(m, prompts()), expected)
        # Kept gathered: each unit once per call; otherwise once per forward (one per new token).
        assert e.comm_report()["all_gather"].calls == gathers
    assert engine.memory_report()["parameters"] == sharded  # sharded again after the call

    with engine.keep_gathered() as held:
        assert held and engine.memory_report()["parameters"] > sharded
        with engine.keep_gathered() as inner:  # nested (generate inside a region): no second gather
            assert inner
        assert engine.memory_report()["parameters"] > sharded
    assert engine.memory_report()["parameters"] == sharded

    # Inside a region the parameters are plain (the guard is lifted); after it, guarded again.
    weight = model.lm_head.weight
    with engine.keep_gathered():
        assert type(weight) is torch.nn.Parameter and torch.equal(weight.detach(), ref.lm_head.weight.detach())
    with pytest.raises(zero_strategy.PartitionedParameterError):
        weight.sum()

    # A forward with gradients inside a region, its backward after it, and a weight used
    # outside its module (as TRL uses lm_head.weight): what autograd saved stays gathered
    # until that backward, and the step matches plain torch.
    batch = train_batch(0, 1)
    with engine.keep_gathered():
        loss = loss_through_lm_head_weight(model, batch)
    engine.backward(loss)
    engine.step()
    ref.zero_grad()
    loss_through_lm_head_weight(ref, batch).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    assert engine.memory_report()["parameters"] == sharded
    full = engine.full_state_dict()
    assert max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items()) < 1e-6
    expected = greedy(ref, prompts())
    assert torch.equal(greedy(model, prompts()), expected)

    # A deep copy is not the engine's: it gets a plain bound generate of its own.
    with engine.gathered_parameters():
        twin = copy.deepcopy(model)
    assert twin.generate.__self__ is twin and not hasattr(twin.generate, "original")

    engine.close()
    assert "generate" not in model.__dict__ and type(model).generate is type(ref).generate
    off.close()
    stage2 = zero_strategy.initialize(tiny_llama(), None, dict(stage=2))
    assert "generate" not in stage2.module.__dict__  # nothing to keep gathered below stage 3
    with stage2.keep_gathered() as held:
        assert held


def test_generate_of_a_submodule_is_wrapped_too():
    """A LightningModule holding a transformers model calls ``self.model.generate``."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llm = tiny_llama()

    ref, holder = tiny_llama(), Holder()
    engine = stage3(holder)
    engine.reset_comm_report()
    assert torch.equal(greedy(holder.llm, prompts()), greedy(ref, prompts()))
    assert engine.comm_report()["all_gather"].calls == partitioned_units(engine)  # once per unit, not per token
    engine.close()
    assert "generate" not in holder.llm.__dict__


def test_a_name_that_is_not_a_method_is_refused_before_anything_is_installed():
    import zero_strategy

    model = tiny_llama()
    with pytest.raises(ValueError, match=r"keep_gathered_methods names 'config', but LlamaForCausalLM.config is not a method"):
        stage3(model, keep_gathered_methods=["generate", "config"])
    assert zero_strategy.engine_of(model) is None and "generate" not in model.__dict__
    stage3(model).close()  # the model was left as it was: a new engine takes it
    with pytest.raises(ValueError, match="keep_gathered_methods must be a list of method names"):
        zero_strategy.ZeroConfig(keep_gathered_methods=["model.generate"])


def test_over_the_budget_generate_gathers_layer_by_layer_with_one_warning():
    ref, model = tiny_llama(), tiny_llama()
    expected = greedy(ref, prompts())
    engine = stage3(model, keep_gathered_max_bytes=1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.reset_comm_report()
        first, second = greedy(model, prompts()), greedy(model, prompts())
    ours = [w for w in caught if "keep_gathered_max_bytes=1024" in str(w.message)]
    assert len(ours) == 1 and "layer by layer" in str(ours[0].message)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert engine.comm_report()["all_gather"].calls == 2 * partitioned_units(engine) * NEW_TOKENS
    with engine.keep_gathered() as held:
        assert not held
    silent = stage3(tiny_llama(), keep_gathered_max_bytes=0)  # 0: never, and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(greedy(silent.module, prompts()), expected)


# -- two gloo processes, one launch ----------------------------------------------------------------
def _worker(rank, ws):
    ref = tiny_llama()
    ref_at_start = tiny_llama()
    ids = prompts()
    expected = [greedy(ref, ids)]
    for step in range(2):
        reference_step(ref, train_batch(step, ws), ws)
        expected.append(greedy(ref, ids))
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    out = {"tokens_change_with_training": not torch.equal(expected[0], expected[1]) and not torch.equal(expected[1], expected[2])}

    for name, extra in (("kept", {}), ("off", {"keep_gathered_methods": []}), ("over_budget", {"keep_gathered_max_bytes": 1})):
        model = tiny_llama()
        engine = stage3(model, **extra)
        sharded = engine.memory_report()["parameters"]
        got = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name != "off":
                # The ranks decode different lengths, synced_gpus left to generate(), which turns
                # the lockstep on for a model marked as FSDP-managed (the Accelerate integration's
                # mark for stage 3): held, each rank may stop on its own with no per-token
                # all-reduce; gathered layer by layer, the lockstep is needed, and is on even
                # without the mark (a rank that stopped early would strand the other's gathers).
                model._is_fsdp_managed_module = name == "kept"
                mine = 2 if rank == 0 else NEW_TOKENS
                tokens, got["lockstep_all_reduces"] = counting_all_reduces(
                    lambda: greedy(model, ids, synced_gpus=None, new_tokens=mine))
                got["uneven_lengths"] = torch.equal(tokens, greedy(ref_at_start, ids, new_tokens=mine))
            engine.reset_comm_report()
            # synced_gpus, as transformers sets it for a stage-3 model under Accelerate
            got["before"] = torch.equal(greedy(model, ids, synced_gpus=True), expected[0])
            got["gathers"] = engine.comm_report()["all_gather"].calls
            got["resharded"] = engine.memory_report()["parameters"] == sharded
            # Training after generate(): the update must reach the next generate().
            engine_step(engine, model, train_batch(0, ws), rank, ws)
            got["after_step"] = torch.equal(greedy(model, ids, synced_gpus=True), expected[1])
            # An RL-style loop inside one region: generate, train, generate again.
            with engine.keep_gathered() as held:
                got["held"] = held
                got["region_start"] = torch.equal(greedy(model, ids, synced_gpus=True), expected[1])
                engine_step(engine, model, train_batch(1, ws), rank, ws)
                got["region_after_step"] = torch.equal(greedy(model, ids, synced_gpus=True), expected[2])
            got["resharded_at_end"] = engine.memory_report()["parameters"] == sharded
        got["warnings"] = sum("keep_gathered_max_bytes" in str(w.message) for w in caught)
        full = engine.full_state_dict(rank0_only=False)
        got["max_param_diff"] = max(float((full[k] - ref_state[k]).abs().max()) for k in full)
        got["units"] = partitioned_units(engine)
        engine.close()
        out[name] = got
    return out


@pytest.mark.slow
def test_stage3_generate_matches_the_single_process_model_and_training_after_it_too():
    for rank, r in enumerate(run_distributed(_worker, 2)):
        assert r["tokens_change_with_training"]  # otherwise a stale copy would go unnoticed
        for name in ("kept", "off", "over_budget"):
            got = r[name]
            assert got["before"] and got["after_step"], (name, got)
            assert got["region_start"] and got["region_after_step"], (name, got)
            assert got["resharded"] and got["resharded_at_end"], (name, got)
            assert got["max_param_diff"] < 1e-5, (name, got["max_param_diff"])
        units = r["kept"]["units"]
        assert r["kept"]["gathers"] == units and r["kept"]["held"]
        assert r["off"]["gathers"] == units * NEW_TOKENS and r["off"]["held"]
        assert r["over_budget"]["gathers"] == units * NEW_TOKENS and not r["over_budget"]["held"]
        assert r["over_budget"]["warnings"] == (1 if rank == 0 else 0)
        assert r["kept"]["warnings"] == r["off"]["warnings"] == 0
        assert r["kept"]["uneven_lengths"] and r["over_budget"]["uneven_lengths"]
        assert r["kept"]["lockstep_all_reduces"] == 0  # was one per new token under Accelerate's mark
        assert r["over_budget"]["lockstep_all_reduces"] >= NEW_TOKENS  # every rank steps until the longest is done
