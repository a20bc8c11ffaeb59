"""The core's owners one at a time, against a fake communicator (no process group).

The fake communicator plays every rank: a ParamShard for each rank is built, and an
all-gather concatenates their contributions; a reduce-scatter sums the inputs every
rank gave (the test supplies them).  Each check compares with plain tensor arithmetic
on the whole (unsharded) values."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

from zero_strategy.sharding.grad_storage import OwnerSliceGrads, ShardedGrads
from zero_strategy.sharding.layout import FlatLayout
from zero_strategy.sharding.param_shard import ParamShard, ShardState


class _Done:
    def wait(self):
        return True


class FakeComm:
    """Records every collective; all_gather takes each rank's input from ``peers``."""

    gradient_quantization = None  # qgZ off: the reducer reduce-scatters in one level

    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank = world_size, 0
        self.calls = []
        self.peers = None  # per-rank ParamShards: rank r contributes its shard (or its master, cast)

    def all_gather(self, full_out, shard_in, async_op=True, label=""):
        self.calls.append(("all_gather", label, full_out.numel()))
        parts = ([p.shard if p.shard is not None else p.master for p in self.peers] if self.peers
                 else [shard_in] * self.world_size)
        full_out.copy_(torch.cat([t.to(full_out.dtype) for t in parts]))
        return _Done()

    def reduce_scatter(self, out, full, async_op=True, label="", scratch=False, kept=False, rider=None):
        self.calls.append(("reduce_scatter", label, full.numel()))
        if rider is not None:
            rider.mul_(self.world_size)
        n = out.numel()
        out.copy_(full[self.rank * n : (self.rank + 1) * n] * self.world_size)  # identical peers
        return _Done()

    def all_reduce(self, t, async_op=True, label="", rider=None, room_after=False):
        self.calls.append(("all_reduce", label, t.numel()))
        if rider is not None:
            rider.mul_(self.world_size)
        t.mul_(self.world_size)
        return _Done()


def _params(seed=0, shapes=((5, 3), (7,), (2, 2))):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _stage3_shards(world, dtype=torch.bfloat16, keep_master=True):
    originals = [p.detach().clone() for p in _params()]
    shards = []
    for r in range(world):
        params = [nn.Parameter(t.clone()) for t in originals]
        layout = FlatLayout(tuple(p.numel() for p in params), world)
        shards.append(ParamShard(params, layout, r, whole=False, compute_dtype=dtype, keep_master=keep_master,
                                 device=torch.device("cpu"), master_device=torch.device("cpu")))
    return originals, shards


def test_partitioned_bf16_shard_keeps_only_the_fp32_master_and_gathers_the_cast():
    originals, shards = _stage3_shards(4)
    comm = FakeComm(4)
    comm.peers = shards
    flat = torch.cat([t.reshape(-1) for t in originals])
    for r, s in enumerate(shards):
        assert s.state is ShardState.SHARDED and s.shard is None  # no 16-bit shard at rest
        assert s.bytes()["parameters"] == 0
        lo, hi = s.layout.shard_range(r)
        real = min(hi, flat.numel()) - lo
        assert torch.equal(s.local_values()[:real], flat[lo : lo + real])  # exact fp32, not rounded
    s = shards[1]
    s.start_gather(comm, "unit x")
    assert s.state is ShardState.GATHERING
    s.finish_gather()
    assert s.state is ShardState.GATHERED
    for p, t in zip(s.params, originals):
        assert torch.equal(p.data, t.to(torch.bfloat16))
    s.release()
    assert s.state is ShardState.SHARDED and s.full.untyped_storage().nbytes() == 0
    assert comm.calls == [("all_gather", "unit x", s.layout.padded_numel)]


def test_partitioned_gather_allocates_only_the_full_buffer():
    """Casting the fp32 master for a stage-3 gather makes no shard-sized temporary: the
    only memory the gather takes is the gathered unit itself (this rank's chunk of it
    is the all-gather's input), so nothing more is alive while gathers are in flight."""
    from torch.profiler import ProfilerActivity, profile

    _, shards = _stage3_shards(2, keep_master=True)
    s = shards[0]
    seen = []

    class RecordingComm:
        def all_gather(self, full_out, shard_in, async_op=True, label=""):
            seen.append((full_out.untyped_storage().data_ptr(), shard_in.untyped_storage().data_ptr(),
                         shard_in.numel()))
            return _Done()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        s.start_gather(RecordingComm(), "u")
        s.finish_gather()
    allocated = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.nbytes() > 0)
    assert allocated == s.layout.padded_numel * 2, allocated  # the bf16 unit, nothing else
    full_ptr, in_ptr, n = seen[0]
    assert in_ptr == full_ptr and n == s.layout.shard_numel
    lo, hi = s.layout.shard_range(0)
    assert torch.equal(s.full[lo:hi], s.master.to(torch.bfloat16))  # its own chunk holds the cast


def test_write_reaches_every_copy_and_only_the_owned_range():
    originals, shards = _stage3_shards(3, dtype=torch.float16)
    new = [torch.full_like(t, 0.25) for t in originals]
    for s in shards:
        for i, t in enumerate(new):
            s.write(i, t.reshape(-1))  # the whole tensor: each shard keeps its own part
    comm = FakeComm(3)
    comm.peers = shards
    s = shards[2]
    s.start_gather(comm, "u")
    s.finish_gather()
    assert all(torch.equal(p.data.float(), t) for p, t in zip(s.params, new))
    s.release()
    for r, s in enumerate(shards):
        for i in range(len(new)):
            owned = s.owned_range(i)
            lo, hi = s.layout.shard_range(r)
            off, n = s.layout.offsets[i], s.layout.numels[i]
            expect = (max(lo, off) - off, min(hi, off + n) - off) if max(lo, off) < min(hi, off + n) else None
            assert owned == expect


def test_whole_shard_is_a_view_of_the_gathered_buffer():
    params = _params()
    layout = FlatLayout(tuple(p.numel() for p in params), 2)
    s = ParamShard(params, layout, 1, whole=True, compute_dtype=torch.bfloat16, keep_master=True,
                   device=torch.device("cpu"), master_device=torch.device("cpu"))
    assert s.state is ShardState.GATHERED and s.shard.data_ptr() == s.full[s.lo :].data_ptr()
    s.master.add_(1.0)
    s.refresh_compute_copy()
    assert torch.equal(s.shard, s.master.to(torch.bfloat16))


def test_sharded_grads_accumulate_reduce_and_free_between_steps():
    params = _params()
    layout = FlatLayout(tuple(p.numel() for p in params), 2)
    grads = ShardedGrads(params, layout, 0, compute_dtype=torch.float32, reduce_dtype=torch.float32, device=torch.device("cpu"))
    comm = FakeComm(2)
    local = [torch.randn_like(p) for p in params]
    for i, (p, g) in enumerate(zip(params, local)):
        p.grad = g.clone()
        grads.accept(i)
        assert p.grad is not None and grads.bucket is None  # waits where autograd put it
    assert grads.complete
    full = grads.reduction_input(2)
    assert all(p.grad is None for p in params)  # folded into the bucket
    out = grads.reduction_output()
    comm.reduce_scatter(out, full)
    grads.finish_reduction(out)
    flat = torch.cat([g.reshape(-1) for g in local])
    lo, hi = layout.shard_range(0)
    torch.testing.assert_close(grads.reduced()[: hi - lo], flat[lo:hi])  # the mean of two identical ranks
    assert grads.bucket is None
    grads.zero()
    assert grads.bytes()["gradients"] == 0  # freed until the next reduction
    assert torch.equal(grads.reduced(), torch.zeros(layout.shard_numel))  # re-grown as zeros


def test_sharded_grads_make_the_bucket_only_when_the_unit_is_reduced():
    # No unit-sized bucket sits beside the activations while backward runs: a block's
    # gradients wait in p.grad (the root unit's final norm gets its gradient first in
    # backward, its embedding last) until the reducer launches the unit.
    params = _params(shapes=((100, 10), (4,), (4,)))
    layout = FlatLayout(tuple(p.numel() for p in params), 2)
    grads = ShardedGrads(params, layout, 0, compute_dtype=torch.float32, reduce_dtype=torch.float32, device=torch.device("cpu"))
    local = [torch.randn_like(p) for p in params]
    before = grads.bytes()["gradients"]
    for i in (2, 1, 0):  # the large gradient last, as the embedding's comes
        params[i].grad = local[i].clone()
        grads.accept(i)
        assert grads.bucket is None and params[i].grad is not None
    # What waits is the unit's full-size gradient, counted as the bucket it becomes.
    assert grads.bytes()["communication_buffers"] == (layout.numels[0] + 8) * 4
    assert grads.bytes()["gradients"] == before
    assert grads.complete
    full = grads.reduction_input(1)
    assert grads.bucket is not None and all(p.grad is None for p in params)
    torch.testing.assert_close(full[: layout.numels[0] + 8], torch.cat([g.reshape(-1) for g in local]))
    # Only small gradients in a backward: the reduction makes the bucket from them.
    grads.zero()
    params[1].grad = local[1].clone()
    grads.accept(1)
    assert grads.bucket is None
    full = grads.reduction_input(1)
    off = layout.offsets[1]
    assert torch.equal(full[off : off + 4], local[1]) and params[1].grad is None
    assert int(torch.count_nonzero(full)) == 4
    # zero() before the reduction drops what waited in p.grad.
    grads.zero()
    params[2].grad = local[2].clone()
    grads.accept(2)
    grads.zero()
    assert params[2].grad is None and grads.bucket is None


def test_owner_slice_grads_keep_only_this_ranks_reduced_slice():
    params = _params()
    layout = FlatLayout(tuple(p.numel() for p in params), 2)
    grads = OwnerSliceGrads(params, layout, 1, compute_dtype=torch.float32, reduce_dtype=torch.float32, device=torch.device("cpu"))
    comm = FakeComm(2)
    comm.rank = 1
    for i, p in enumerate(params):
        p.grad.add_(1.0)  # views into the persistent buffer
        grads.accept(i)
    full = grads.reduction_input(2)
    out = grads.reduction_output()
    comm.reduce_scatter(out, full)
    grads.finish_reduction(out)
    lo, hi = layout.shard_range(1)
    assert bool((grads.full[:lo] == 0).all())
    assert torch.equal(grads.reduced(), torch.ones(hi - lo))


def test_reducer_launches_in_fixed_order_whatever_order_gradients_arrive():
    from zero_strategy.config import ZeroConfig
    from zero_strategy.sharding.flat_unit import FlatUnit
    from zero_strategy.policy import Policies
    from zero_strategy.sharding.reducer import GradientReducer

    pol = Policies.from_config(ZeroConfig(stage=2))
    units = [FlatUnit(i, _params(i), [[f"u{i}.{j}"] for j in range(3)], group_index=0, policies=pol, rank=0,
                      world_size=2, whole=True, label=f"u{i}") for i in range(3)]
    comm = FakeComm(2)
    reducer = GradientReducer(units, comm, overlap=True, max_in_flight=10**6)
    for u in reversed(units):  # the last unit completes first
        for j, p in enumerate(u.params):
            p.grad = torch.ones_like(p)
            u.grads.accept(j)
            reducer.on_grad_ready(u, synced=True)
    assert [c[1] for c in comm.calls] == ["the gradients of u0", "the gradients of u1", "the gradients of u2"]
    reducer.flush(synced=True)
    assert len(comm.calls) == 3


def test_a_dropped_engine_frees_everything():
    """initialize + one step + del: nothing of the engine, model or optimizer stays alive."""
    import zero_strategy
    from models import tiny_gpt2

    def build_and_drop(stage):
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = zero_strategy.initialize(model, opt, dict(stage=stage, precision="bf16", param_persistence_threshold=0))
        ids = torch.randint(0, 96, (2, 8))
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.step()
        refs = [weakref.ref(engine), weakref.ref(model), weakref.ref(opt)]
        refs += [weakref.ref(u.params_store.master) for u in engine.units if u.params_store.master is not None]
        return refs

    for stage in (0, 1, 2, 3):
        refs = build_and_drop(stage)
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert not alive, (stage, [type(a).__name__ for a in alive])
