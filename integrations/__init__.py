"""Framework adapters for zero_strategy (Lightning, Accelerate). No sharding logic lives here."""
