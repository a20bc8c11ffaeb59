"""Setting a communicator up for more than one node: the topology, and ZeRO++'s parts.

The engine resolves the topology from the config and this rank's launcher variables
(:func:`resolve_topology`, no collective) before its setup check, which compares the
ranks per node every rank found; then, after the check (every rank has the same config
and layout, so every rank builds the same sub-groups in the same order) and before the
model is cut, :func:`set_up`.

* The node structure ([Note: node structure] in topology.py) is resolved from the
  config or the launcher; a launcher that says there are several nodes is checked
  against every rank's own report (one small all-gather), so an interleaved or uneven
  layout fails at start-up, on every rank, naming each rank's node.
* hpZ (``secondary_partition``) needs the node communicator; qgZ
  (``gradient_quantization``) needs it and the cross communicator (the ranks with the
  same local rank on every node).  Both are built only when asked for.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .topology import Topology, check_layout, launcher_identity, resolve

BITS = {"int8": 8, "int4": 4}


def resolve_topology(config) -> Topology:
    """This rank's view of the node structure: the config's, else its launcher's."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return resolve(world, config.ranks_per_node)


def set_up(comm, config, topology: Topology) -> Topology:
    """Give ``comm`` its topology and, if the config asks for ZeRO++, its node and
    cross-node sub-communicators; returns the topology."""
    world = topology.world_size
    if topology.multi_node and config.ranks_per_node is None and comm.world_size > 1:
        reports = comm.all_gather_object(launcher_identity(), label="each rank's node (the launcher's layout)")
        problem = check_layout(topology, reports)
        if problem is not None:
            raise ValueError(problem + "\nSet ranks_per_node in the ZeRO config if the launcher's variables are not "
                             "what this job runs on.")
    comm.set_topology(topology)
    hpz = config.secondary_partition is not None
    qgz = config.gradient_quantization is not None
    if not (hpz or qgz) or comm.world_size == 1:
        return topology
    if topology.uneven:
        raise ValueError(
            f"secondary_partition and gradient_quantization need nodes of equal size; the launcher says they differ "
            f"({topology.uneven}). Run the same number of ranks on every node, or set ranks_per_node to group the "
            "ranks yourself."
        )
    if comm.global_ranks() != list(range(world)):
        raise ValueError(
            "secondary_partition and gradient_quantization need the engine to run on every rank of the job (its "
            "process group is a subset): the node groups they build span the whole job. Leave process_group unset, "
            "or turn these options off."
        )
    comm.node_comm = comm.sub([topology.node_ranks(n) for n in range(topology.nodes)], "this node's ranks")
    if qgz:
        comm.cross_comm = comm.sub([topology.peers_across(l) for l in range(topology.ranks_per_node)],
                                   "the ranks with this local rank on every node")
        comm.gradient_quantization = (BITS[config.gradient_quantization], config.quantization_block_size)
    return topology


def keeps_secondary(config) -> bool:
    """hpZ: whether partitioned units keep a node slice from forward to backward."""
    return config.secondary_partition is not None


def weight_quantization(config) -> Optional[tuple]:
    """(bits, block) for qwZ, or None."""
    if config.weight_quantization is None:
        return None
    return (BITS[config.weight_quantization], config.quantization_block_size)


def describe(topology: Topology, config) -> str:
    """The start-up line's part: the topology and which of ZeRO++'s parts are on."""
    parts = []
    if config.secondary_partition is not None:
        parts.append("hpZ")
    if config.weight_quantization is not None:
        parts.append(f"qwZ {config.weight_quantization}")
    if config.gradient_quantization is not None:
        parts.append(f"qgZ {config.gradient_quantization}")
    zpp = f", ZeRO++: {' + '.join(parts)} (block {config.quantization_block_size})" if parts else ""
    if parts and not any(p.startswith("q") for p in parts):
        zpp = ", ZeRO++: hpZ"
    return f"{topology.describe()} (from {topology.source}){zpp}"


__all__ = ["BITS", "describe", "keeps_secondary", "resolve_topology", "set_up", "weight_quantization"]
