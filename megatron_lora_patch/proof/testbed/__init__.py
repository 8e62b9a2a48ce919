"""Testing helpers: CPU/gloo world launcher (launcher), topology value type and Megatron setup (topology), tiny models,
training driver."""
