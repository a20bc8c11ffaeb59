"""What runs around the user's forward and backward: the module hooks that gather,
reduce and cast (hooks), activation checkpointing with host offload (activation), and
autocast mode (autocast_forward)."""
