"""Training-time pieces: the SUM of replicated factor grads over their shard domain and the
activation-recompute fix (docs/architecture.md sections 4-5)."""
