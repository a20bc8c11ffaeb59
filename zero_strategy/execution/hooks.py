"""Every hook the engine installs, registered in one place and returned as handles.

* Each trainable parameter: a post-accumulate-grad hook feeding its unit's bucket.
* The root module: a forward pre-hook (input casting, per-step bookkeeping) and a
  forward hook (stage 3: release whatever a lazy gather left behind); with
  ``autocast=True`` also the pair that runs forward under torch.autocast
  (autocast_forward.py).
* Stage 3 only: state-dict hooks on the root, so ``model.state_dict()`` consolidates
  (module_state_dict.py); pre/post forward hooks on every unit module (each member of a merged group), and lazy pre-hooks on
  modules that own partitioned parameters (so calling such a submodule on its own,
  e.g. ``model.get_input_embeddings()(ids)``, gathers what it needs instead of failing).
"""
from __future__ import annotations

import weakref
from typing import List

import torch
from torch.utils._pytree import tree_map

from .autocast_forward import register_autocast
from ..state_dicts.module_state_dict import register_state_dict_hooks


def register_hooks(engine) -> List[torch.utils.hooks.RemovableHandle]:
    handles = []
    # Parameter hooks live on autograd's C++ side, which the garbage collector cannot
    # see through: a strong reference to the engine there would keep a dropped engine
    # (and its model and buffers) alive for ever.  They hold weak references.
    engine_ref = weakref.ref(engine)
    for unit in engine.units:
        if not unit.trainable:
            continue
        unit_ref = weakref.ref(unit)
        for pos, p in enumerate(unit.params):
            handles.append(p.register_post_accumulate_grad_hook(
                lambda _p, e=engine_ref, u=unit_ref, i=pos: _forward_grad(e, u, i)))

    root = engine.module
    handles.append(root.register_forward_pre_hook(_eager(lambda m, a, k: engine._on_root_pre_forward(a, k)), with_kwargs=True))
    handles.append(root.register_forward_hook(_eager(lambda m, a, o: engine._on_root_post_forward())))
    if engine.policies.precision.autocast_dtype is not None:
        handles.extend(register_autocast(root, engine.policies.precision.autocast_dtype, lambda: _device_type(root)))

    gatherer = engine.gatherer
    if gatherer is None:
        return handles
    handles.extend(register_state_dict_hooks(engine))
    for group in gatherer.groups:

        def pre(module, args, kwargs, g=group):
            gatherer.pre_forward(g)
            return gatherer.wrap_inputs_for_post_backward(g, args, kwargs, module)

        def post(module, args, output, g=group):
            gatherer.post_forward(g, output, module)

        for member in group.members:  # several for a merged group (gather.py, [Note: merged groups])
            handles.append(member.register_forward_pre_hook(_eager(pre), with_kwargs=True))
            handles.append(member.register_forward_hook(_eager(post)))

    # Lazy gathering for direct calls to submodules holding partitioned parameters.
    group_of_param = {}
    for group in gatherer.groups:
        for unit in group.units:
            for p in unit.params:
                group_of_param[id(p)] = group
    for module in engine.module.modules():
        if id(module) in gatherer.by_module:
            continue
        groups = {id(group_of_param[id(p)]): group_of_param[id(p)] for p in module.parameters(recurse=False) if id(p) in group_of_param}
        if not groups:
            continue

        def lazy(module, args, gs=tuple(groups.values())):
            for g in gs:
                if not g.gathered:
                    gatherer.ensure_gathered(g)
                else:
                    g.wait()

        handles.append(module.register_forward_pre_hook(_eager(lazy)))
    return handles


def _eager(hook):
    """Under torch.compile the hooks run eagerly (a graph break at each unit module's
    boundary), so gathers, releases and their collectives happen for real between the
    compiled regions instead of being traced into them (see docs/core.md, torch.compile).
    Without compilation the hook is called directly: going through the disabled wrapper
    costs tens of microseconds a call, several times per module and step."""
    disabled = torch.compiler.disable(hook, recursive=True)

    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # while dynamo traces: break the graph here
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return run


def _device_type(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _forward_grad(engine_ref, unit_ref, pos: int) -> None:
    engine, unit = engine_ref(), unit_ref()
    if engine is not None and unit is not None:
        engine._on_param_grad(unit, pos)


def cast_floating_inputs(args, kwargs, dtype: torch.dtype):
    """Mixed precision: floating-point inputs follow the parameters' compute dtype."""

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, args), tree_map(cast, kwargs)
