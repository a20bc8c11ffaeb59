"""Stage 3 with unit modules whose forward returns something other than tensors and
pytree containers: a SimpleNamespace (searched through its attributes) and an object
with __slots__ (cannot be searched: kept gathered until the end of backward).  Losses
and weights must equal plain torch's, with every parameter partitioned."""
import types

import pytest
import torch
import torch.nn as nn


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Block(nn.Module):
    def __init__(self, width, wrap):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.wrap = wrap

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        return types.SimpleNamespace(hidden=y, note="ok") if self.wrap == "namespace" else Slotted(y)


class Net(nn.Module):
    def __init__(self, wrap, width=8, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, wrap) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            out = b(x)
            x = out.hidden if isinstance(out, types.SimpleNamespace) else out.value
        return self.head(x).pow(2).mean()


def _train(model, step, batches):
    losses = []
    for x in batches:
        loss = model(x)
        step(loss)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("wrap", ["namespace", "slots"])
def test_blocks_returning_plain_objects_train_like_plain_torch(wrap, caplog):
    import zero_strategy

    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    torch.manual_seed(0)
    ref = Net(wrap)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def ref_step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = _train(ref, ref_step, batches)

    torch.manual_seed(0)
    model = Net(wrap)
    engine = zero_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      dict(stage=3, param_persistence_threshold=0, unit_modules=["Block"],
                                           min_gather_numel=0))

    def zero_step(loss):
        engine.backward(loss)
        engine.step()
    with caplog.at_level("WARNING", logger="zero_strategy"):
        got = _train(model, zero_step, batches)
    assert got == pytest.approx(want, rel=1e-6)
    sd = engine.full_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), rtol=1e-6, atol=1e-7)
    warned = [r for r in caplog.records if "cannot be found" in r.getMessage()]
    assert len(warned) == (3 if wrap == "slots" else 0), [r.getMessage() for r in warned]
    engine.close()
