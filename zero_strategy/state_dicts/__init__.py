"""Consolidated and per-rank state dicts of the model and optimizers (state) and a
sharded module's own state_dict / load_state_dict (module_state_dict)."""
