"""The oracle: every topology's LoRA training step against a world-size-1 reference (docs/architecture.md section 8)."""
