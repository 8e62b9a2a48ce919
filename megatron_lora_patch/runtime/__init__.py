"""The plugin runtime (docs/architecture.md section 2): start-up hook, plugin registry, hook
specifications, flags, version gate, patch records and errors. It knows nothing of LoRA: plugins
reach it through the hooks of `hookspecs`, and everything here imports only the standard library
and wrapt / pluggy / packaging (never torch or Megatron)."""
