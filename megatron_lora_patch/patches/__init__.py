"""Patch declarations: one module per patch, each a `PatchSpec` naming the Megatron-Core modules it
targets and the `megatron_lora_patch.integrations` hook for each (docs/architecture.md section 3)."""
