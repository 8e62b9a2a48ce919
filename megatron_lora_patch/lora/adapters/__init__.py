"""Adapter math: the logical adapter, its init, the LoRA kernels, Megatron's packed layouts and the
metadata a factor carries (docs/architecture.md section 4). Plain torch; no Megatron state."""
