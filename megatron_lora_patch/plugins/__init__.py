"""The plugins this package ships (entry-point group `megatron_lora_patch.plugins`): each names the
patch declarations of `megatron_lora_patch.patches` it contributes (docs/architecture.md section 2)."""
