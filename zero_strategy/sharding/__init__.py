"""How parameters and gradients are cut and moved: the shard arithmetic (layout), which
parameters form which flat unit (planner), a unit's parameter storage and gradient
storage (one class per stage, one protocol), when gradients are reduced (reducer) and
when stage-3 units are gathered, prefetched and released (gather, keep_gathered), and
whole parameters for optimizers that need them (whole_params)."""
