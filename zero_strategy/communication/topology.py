"""Which ranks share a node, and how many bytes a collective sends across nodes.

[Note: node structure]
Ranks are grouped into nodes of ``ranks_per_node`` consecutive global ranks (rank
``r`` is on node ``r // L``, local rank ``r % L``), the order every launcher users run
gives them: torchrun (``--nnodes``, one agent per node), ``accelerate launch``
(``num_machines``, through torchrun), Lightning (``num_nodes``) and Slurm (``srun``
with torchrun).  Where the number comes from, first match wins:

1. the config's ``ranks_per_node`` (so that one host can simulate several nodes);
2. the launcher's environment: torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's
   ``SLURM_NTASKS_PER_NODE`` (one task per rank) or Lightning's ``NODE_RANK`` /
   ``num_nodes`` (passed by the Lightning strategy as ``ranks_per_node``);
3. otherwise one node holding every rank.

Every rank reads its own launcher variables, so the setup check compares the ranks per
node each rank found (nodes of different sizes fail there, naming each rank's value);
when they say there is more than one node, the engine also checks that ranks are
numbered node by node (an interleaved layout is refused with what each rank reported).
A Slurm job whose nodes hold different numbers of tasks is counted as one node, and
refused by hpZ and qgZ, which need equal nodes.

[Note: direct-exchange bytes]
``comm_report()`` splits what a rank sends into intra-node and cross-node bytes by a
model every collective implementation shares, whatever its algorithm (ring, tree,
NVLink SHARP): the bytes this rank must hand to each other member of the group.

* all-gather of a full tensor of S bytes over g ranks: this rank's S/g to each of
  the g - 1 others; the part for members on other nodes is cross-node.
* reduce-scatter of S bytes: this rank's contribution to each other member's slice,
  S/g each (the same count).
* all-reduce: a reduce-scatter followed by an all-gather, twice the above.
* all-to-all: exactly what each chunk's destination says.
* broadcast of S bytes: S to each other member, from the source only.

A ring moves the same totals (each rank sends S(g - 1)/g), so these numbers are what
the paper counts, split by where the receiver lives; a hierarchical collective (hpZ's
intra-node gather, qgZ's two-level reduction) shows up as bytes moving to the
right side of that split.  ``benchmarks/`` applies the same function to FSDP2's calls,
so both systems are counted alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in nodes of ``ranks_per_node`` consecutive global ranks."""

    world_size: int
    ranks_per_node: int
    source: str = "one node"  # where ranks_per_node came from, for the start-up line
    uneven: Optional[str] = None  # the launcher's nodes hold different numbers of ranks: what it said

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} (from {self.source}) does not divide the world size "
                f"{self.world_size}: every node must hold the same number of ranks. Set ranks_per_node to a divisor "
                "of the world size, or launch the same number of processes on every node."
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> List[int]:
        """The global ranks on ``node``, in order."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peers_across(self, local_rank: int) -> List[int]:
        """The ranks with local rank ``local_rank`` on every node, one per node."""
        return [n * self.ranks_per_node + local_rank for n in range(self.nodes)]

    def describe(self) -> str:
        n, l = self.nodes, self.ranks_per_node
        return f"{n} node{'s' if n != 1 else ''} x {l} rank{'s' if l != 1 else ''}"


def _positive_int(value: Optional[str]) -> Optional[int]:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """SLURM_NTASKS_PER_NODE, or a homogeneous SLURM_TASKS_PER_NODE ("4(x2)" or "4,4")."""
    n = _positive_int(env.get("SLURM_NTASKS_PER_NODE"))
    if n is not None:
        return n
    counts = _slurm_counts(env)
    return counts.pop() if len(counts) == 1 else None


def _slurm_counts(env: Mapping[str, str]) -> set:
    spec = env.get("SLURM_TASKS_PER_NODE") or ""
    return {_positive_int(part.split("(")[0]) for part in spec.split(",") if part.strip()}


def from_launcher(world_size: int, env: Mapping[str, str] = os.environ) -> Topology:
    """The node structure the launcher's environment states (see [Note: node structure])."""
    n = _positive_int(env.get("LOCAL_WORLD_SIZE"))
    if n is not None and world_size % n == 0:
        return Topology(world_size, n, "the launcher (LOCAL_WORLD_SIZE)")
    # Slurm without torchrun: one task per rank (srun --ntasks-per-node).
    n = _slurm_tasks_per_node(env)
    slurm_job = _positive_int(env.get("SLURM_NTASKS")) == world_size
    if n is not None and world_size % n == 0 and slurm_job:
        return Topology(world_size, n, "Slurm (SLURM_NTASKS_PER_NODE)")
    if slurm_job and len(_slurm_counts(env)) > 1:
        return Topology(world_size, world_size, "one node", uneven=f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']}")
    return Topology(world_size, world_size, "one node")


def resolve(world_size: int, ranks_per_node: Optional[int], env: Mapping[str, str] = os.environ) -> Topology:
    if ranks_per_node is not None:
        return Topology(world_size, ranks_per_node, "ranks_per_node")
    return from_launcher(world_size, env)


def launcher_identity(env: Mapping[str, str] = os.environ) -> tuple:
    """What this process's launcher says about where it runs: (node index, local rank,
    ranks on its node); None where the environment does not say."""
    node = _positive_int(env.get("GROUP_RANK"))
    if env.get("GROUP_RANK", "").strip() == "0":
        node = 0
    if node is None:
        for name in ("NODE_RANK", "SLURM_NODEID"):
            value = env.get(name, "").strip()
            if value.isdigit():
                node = int(value)
                break
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "")).strip()
    return (node, int(local) if local.isdigit() else None, _positive_int(env.get("LOCAL_WORLD_SIZE")))


def check_layout(topology: Topology, identities: Sequence[tuple]) -> Optional[str]:
    """Every rank's :func:`launcher_identity`, in rank order: None if they agree with
    ``topology`` (rank r on node r // L with local rank r % L), else why not."""
    bad = []
    for rank, (node, local, size) in enumerate(identities):
        want = (topology.node_of(rank), topology.local_rank(rank), topology.ranks_per_node)
        got = (node, local, size)
        if any(g is not None and g != w for g, w in zip(got, want)):
            bad.append(f"rank {rank}: node {node}, local rank {local}, {size} ranks on its node "
                       f"(expected node {want[0]}, local rank {want[1]}, {want[2]})")
    if not bad:
        return None
    return ("the launcher's node layout is not one this engine can use: ranks must be numbered node by node with "
            f"the same number on every node ({topology.describe()} from {topology.source}).\n  " + "\n  ".join(bad[:8])
            + ("\n  ..." if len(bad) > 8 else ""))


# -- direct-exchange accounting ([Note: direct-exchange bytes]) -------------------------------

@dataclass(frozen=True)
class GroupPlacement:
    """One rank's view of a process group: its size, and how many of the other members
    are on another node than this rank."""

    size: int
    members_elsewhere: int  # on other nodes

    @classmethod
    def of(cls, topology: Topology, group_ranks: Sequence[int], me: int) -> "GroupPlacement":
        my_node = topology.node_of(me)
        return cls(len(group_ranks), sum(1 for r in group_ranks if topology.node_of(r) != my_node))


def sent_bytes(kind: str, nbytes: int, place: GroupPlacement, is_source: bool = True) -> tuple:
    """(intra-node, cross-node) bytes this rank sends for one collective of ``kind``
    whose full tensor has ``nbytes`` bytes (see [Note: direct-exchange bytes]).
    all-to-all is counted by the caller, chunk by chunk."""
    g = place.size
    if g <= 1:
        return (0, 0)
    if kind == "broadcast":
        per_peer = nbytes if is_source else 0
    else:
        per_peer = nbytes / g * (2 if kind == "all_reduce" else 1)
    cross = round(per_peer * place.members_elsewhere)
    total = round(per_peer * (g - 1))
    return (total - cross, cross)


__all__ = ["Topology", "GroupPlacement", "check_layout", "from_launcher", "launcher_identity", "resolve", "sent_bytes"]
