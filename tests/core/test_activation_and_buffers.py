"""ZeRO-R: activation checkpointing (+ host offload) keeps gradients exact and cuts
the memory held between forward and backward; communication buffers stay bounded
by the bucket size whatever the model size (C_B); gradients land in preallocated flat
buffers (M_D)."""
import pytest
import torch

from dist_harness import run_distributed
from models import tiny_gpt2
from parity import reference_run, zero_run
from test_parity import LOSS_TOL, UPDATE_TOL, _relative_update_error


def _worker(rank, ws, jobs):
    import transformers

    transformers.logging.set_verbosity_error()
    return [zero_run(rank, ws, j) for j in jobs]


@pytest.mark.slow
def test_checkpointed_training_matches_reference():
    jobs = [dict(stage=s, precision="fp32", world_size=2, accum=2, steps=3, optim="sgd", checkpointing=("auto",), offload_activations=off)
            for s in (2, 3) for off in (False, True)]
    jobs.append(dict(stage=1, precision="bf16", world_size=2, accum=1, steps=3, optim="adamw", checkpointing=("GPT2Block",)))
    results = run_distributed(_worker, 2, jobs)[0]
    for job, (losses, sd) in zip(jobs, results):
        ref_losses, ref_params = reference_run(job)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOL[job["precision"]], job
        assert _relative_update_error(job, sd, ref_params) < UPDATE_TOL[job["precision"], job["optim"]], job


def _held_between_forward_and_backward(config):
    """Bytes of tensors autograd keeps alive for backward, counted by saved-tensor hooks
    (each storage once) -- independent of the engine's own accounting."""
    import zero_strategy

    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=4, n_embd=64, n_positions=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero_strategy.initialize(model, opt, config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 96, (4, 256), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    engine.close()
    return sum(seen.values()), loss.item()


def test_activation_checkpointing_cuts_memory_held_for_backward():
    plain, loss_plain = _held_between_forward_and_backward(dict(stage=0))
    ckpt, loss_ckpt = _held_between_forward_and_backward(dict(stage=0, activation_checkpointing=["auto"]))
    off, loss_off = _held_between_forward_and_backward(dict(stage=0, activation_checkpointing=["auto"], offload_activations=True))
    assert loss_plain == loss_ckpt == loss_off
    # Four blocks: inside each, attention and MLP intermediates are no longer kept.
    assert ckpt < 0.5 * plain, (plain, ckpt)
    assert off <= ckpt


def test_checkpointed_function_for_hand_written_models():
    from zero_strategy.execution.activation import checkpointed

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    block(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    for p in block.parameters():
        p.grad = None
    x.grad = None
    for offload in (False, True):
        run = checkpointed(block.forward, offload=offload)
        run(x).pow(2).sum().backward()
        got = [p.grad for p in block.parameters()] + [x.grad]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        for p in block.parameters():
            p.grad = None
        x.grad = None


def _buffer_worker(rank, ws, n_layers_list, bucket):
    import transformers

    import zero_strategy

    transformers.logging.set_verbosity_error()
    out = []
    for n_layer in n_layers_list:
        for stage in (2, 3):
            model = tiny_gpt2(n_layer=n_layer, n_embd=64)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            engine = zero_strategy.initialize(model, opt, dict(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0))
            ids = torch.randint(0, 96, (2, 8))
            engine.backward(model(input_ids=ids, labels=ids).loss)
            largest_unit = max(u.layout.padded_numel for u in engine.trainable_units)
            out.append(dict(n_layer=n_layer, stage=stage, peak=engine.reducer.peak_in_flight, largest=largest_unit,
                            psi=sum(p.numel() for p in model.parameters())))
            engine.step()
            engine.close()
    return out


@pytest.mark.slow
def test_communication_buffers_stay_bounded_as_the_model_grows():
    bucket = 20_000
    results = run_distributed(_buffer_worker, 2, (2, 8), bucket)[0]
    for r in results:
        # Two buckets in flight; a unit bigger than that alone.
        bound = max(2 * bucket, r["largest"])
        assert r["peak"] <= bound, r
    small = [r for r in results if r["n_layer"] == 2]
    big = [r for r in results if r["n_layer"] == 8]
    for s, b in zip(small, big):
        assert b["psi"] > 2.5 * s["psi"]
        # Stage 2: same bound for a model 3x the size. Stage 3: one block at a time.
        assert b["peak"] <= max(2 * bucket, s["largest"], b["largest"])


def test_stage_0_and_1_gradients_are_views_of_one_preallocated_flat_buffer():
    import zero_strategy

    for stage in (0, 1):
        model = tiny_gpt2()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zero_strategy.initialize(model, opt, dict(stage=stage))
        ids = torch.randint(0, 96, (2, 8))
        for _ in range(2):
            engine.backward(model(input_ids=ids, labels=ids).loss)
            for u in engine.trainable_units:
                base = u.grads.full.untyped_storage().data_ptr()  # the storage's documented buffer
                assert all(p.grad.untyped_storage().data_ptr() == base for p in u.params)
            engine.step()
        engine.close()


def test_offloaded_checkpoints_come_back_one_block_ahead_of_backward():
    """Blocks sharing an OffloadSchedule: every recomputation but the first one of
    backward finds its inputs already brought back, gradients equal the plain run, and
    nothing stays registered after backward."""
    from zero_strategy.execution.activation import OffloadSchedule, checkpointed

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)) for _ in range(4)]
    x = torch.randn(4, 8, requires_grad=True)

    def run(forwards):
        h = x
        for f in forwards:
            h = f(h) + h
        h.pow(2).sum().backward()
        grads = [p.grad.clone() for b in blocks for p in b.parameters()] + [x.grad.clone()]
        for b in blocks:
            b.zero_grad(set_to_none=True)
        x.grad = None
        return grads

    expected = run([b.forward for b in blocks])
    schedule = OffloadSchedule()
    wrapped = [checkpointed(b.forward, offload=True, schedule=schedule) for b in blocks]
    for iteration in range(2):
        got = run(wrapped)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        assert schedule.fetches == 4 * (iteration + 1)
        assert schedule.prefetch_hits == 3 * (iteration + 1)
        assert len(schedule._live) == 0
