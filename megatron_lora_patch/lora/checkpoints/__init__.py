"""Adapters in checkpoints: adapter-only files, Megatron distributed checkpoints with the factors'
true sharding, and reading either back (docs/architecture.md section 4)."""
