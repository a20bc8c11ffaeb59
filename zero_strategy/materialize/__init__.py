"""Parameters that do not exist yet: ``init_context`` (parameters on meta) and deferred
initialisation granule by granule (deferred), loading pretrained safetensors into shards
(each rank reads only its rows), and binding a checkpoint's tensors to a model's
parameters by object.  The names below are the public API of ``zero_strategy.materialize``."""
from .binding import BoundWeights, CheckpointBinding, bind
from .deferred import in_init_context, init_context, keep_meta_on_moves
from .weight_files import file_inside, weight_files

__all__ = ["BoundWeights", "CheckpointBinding", "bind", "file_inside", "in_init_context", "init_context", "keep_meta_on_moves", "weight_files"]
