"""The user's optimizers over the shards: re-pointing them and the facade frameworks call
(optimizer), which optimizers are element-wise (optimizer_kinds), several optimizers and
their step rounds (optimizer_set), the step unit by unit (stepper), the fused host step
(host_step) and the fp16 loss scaler (loss_scale)."""
