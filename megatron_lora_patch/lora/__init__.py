"""The LoRA library, grouped in rooms by concern (docs/architecture.md section 2): `config` (what to
adapt and how), `adapters` (adapter math and kernels), `layers` (LoRA on Megatron's layers),
`training` (grad sync, recompute), `inventory` (what a live model holds: adapters, description),
`checkpoints` and `exchange` (PEFT). Plain modules, testable without any patching; imports point from
`exchange` / `checkpoints` / `inventory` / `training` / `layers` down to `adapters` and `config`, never back up."""
