"""LoRA on Megatron's layers: attaching adapters to a built model, the linear and Transformer Engine
forwards that add the LoRA term on the base layer's collectives, fully trained modules and the
refusals for layers LoRA cannot adapt (docs/architecture.md section 4)."""
