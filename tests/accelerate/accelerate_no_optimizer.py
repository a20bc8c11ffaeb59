"""Accelerate's own distributed tests that prepare a model WITHOUT an optimizer, run as they
ship in the installed accelerate (accelerate/test_utils/scripts): the no_sync checks of
test_sync.py, and what the join tests of test_distributed_data_loop.py need.  Launched by
tests/accelerate/test_accelerate_no_optimizer.py under a DDP config and under zero_config sections;
does not import zero_strategy.  Writes which tests ran, and the Accelerator class, to argv[1]."""
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.test_utils.scripts import test_sync
from torch.distributed.algorithms import Joinable


def main():
    accelerator = Accelerator()
    ran = []
    # In test_sync.main's order (the break test expects no active dataloader yet).
    test_sync.test_dataloader_break()
    ran.append("test_sync.test_dataloader_break")
    for name in ("test_distributed_sync", "test_distributed_sync_multiple_fwd"):
        getattr(test_sync, name)(accelerator)
        ran.append(f"test_sync.{name}")
    # The join tests of test_distributed_data_loop.py need what prepare(model) returns to
    # be a Joinable (DDP); on CPU, join_uneven_inputs is a no-op and those tests fail or
    # hang with plain DDP as well, so only that part is recorded here.
    prepared = accelerator.prepare(torch.nn.Linear(1, 1))
    joinable = isinstance(prepared, Joinable)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(sys.argv[1], "w") as f:
            json.dump({"ran": ran, "prepared_class": type(prepared).__name__, "joinable": joinable, "accelerator_class": type(accelerator).__name__,
                       "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
