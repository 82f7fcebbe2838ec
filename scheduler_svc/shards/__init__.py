"""Step shards: processes that run the step loops of a subset of the workers, for a leader
that keeps the global queue (docs/architecture.md, "Step shards")."""
