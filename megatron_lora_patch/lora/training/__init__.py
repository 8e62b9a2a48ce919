"""Training-time pieces: the SUM of replicated factor grads over their shard domain, the
activation-recompute fix (docs/architecture.md sections 4-5) and the adapters' part in DDP's
overlapped param all-gather (param_sync.py)."""
