"""LoRA math for Megatron-Core linear layers: plain modules, testable without any patching."""
