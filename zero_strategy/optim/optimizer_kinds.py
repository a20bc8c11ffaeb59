"""Which optimizers may be handed flat shard pieces, and which need whole parameters.

[Note: element-wise or whole-parameter]
ZeRO splits each parameter's flat space over the ranks, so by default an optimizer
sees one piece of a parameter per rank ([Note: one optimizer tensor per parameter] in
flat_unit.py).  That is exact only for an *element-wise* optimizer, whose update of
each element reads nothing but that element's gradient and state (SGD, Adam, ...).
An optimizer whose update depends on the whole parameter (Adafactor factors its second
moment over rows and columns, Muon orthogonalises the whole matrix, LAMB and LARS scale
by the parameter's norm, Shampoo and SOAP precondition by its shape) would silently
compute something else on a piece.

The rule, correct first:

* element-wise: exactly torch's built-in per-element classes (``PER_PARAMETER``), and
  class names the user lists in ``ZeroConfig.elementwise_optimizers``;
* every other optimizer gets whole parameters ([Note: whole-parameter optimizers] in
  whole_params.py), a subclass of Adam included (it may override the update).

Stepping unit by unit (stepper.py) is a separate question: it needs an optimizer whose
``step()`` touches nothing but the tensors in its groups, so that one call per unit
equals one call over everything.  torch's per-element classes and the known
per-parameter whole-tensor ones (``UNIT_BY_UNIT_WHOLE``) qualify; an optimizer the
engine does not know gets one ``step()`` call per engine step.
"""
from __future__ import annotations

from typing import Iterable

import torch

PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

# Whole-tensor optimizers whose step() updates each parameter from its own gradient and
# state alone (no cross-parameter reduction, no per-call counter), named by module and
# class so that no optional package is imported to recognise them.
UNIT_BY_UNIT_WHOLE = frozenset({
    ("torch.optim", "Muon"),
    ("torch.optim", "Adafactor"),
    ("transformers.optimization", "Adafactor"),
})


def _qualified(optimizer) -> tuple:
    cls = type(optimizer)
    return cls.__module__, cls.__qualname__


def is_elementwise(optimizer: torch.optim.Optimizer, declared: Iterable[str] = ()) -> bool:
    """Whether ``optimizer`` may update flat shard pieces (see the module note)."""
    return type(optimizer) in PER_PARAMETER or type(optimizer).__name__ in set(declared)


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether one ``step()`` per unit equals one ``step()`` over every unit (hooks aside)."""
    return type(optimizer) in PER_PARAMETER or _qualified(optimizer) in UNIT_BY_UNIT_WHOLE


def kind_name(optimizer: torch.optim.Optimizer, declared: Iterable[str] = ()) -> str:
    return "element-wise" if is_elementwise(optimizer, declared) else "whole-parameter"
