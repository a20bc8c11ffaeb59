"""What the Trainer and Fabric strategies share about processes and collectives.

Written against ``lightning.fabric``; ``_process_group_standalone`` is its twin for
``lightning_fabric`` (see ``_twin``).  The strategies keep their own
``setup_environment`` (the Trainer also resets the seed) and call
:meth:`ZeroProcessGroupMixin._init_process_group` from it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.utilities import distributed as dist_utils
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only


class ZeroProcessGroupMixin:
    """Mixed in before the distribution's ``ParallelStrategy``."""

    #: The distribution's ``_SubprocessScriptLauncher``: the Trainer's and Fabric's differ,
    #: so each strategy names its own.
    script_launcher_class: type

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.script_launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def _publish_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Both holders, as Lightning's own strategies do (today they are one object).
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _init_process_group(self) -> None:
        if self._process_group_backend is None:
            self._process_group_backend = dist_utils._get_default_process_group_backend_for_device(self.root_device)
        kwargs: dict = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        dist_utils._init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def _sync_tensor(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return dist_utils._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not dist_utils._distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist_utils._distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=dist_utils.group.WORLD)
        return box[0]
