"""Adapters from a live Megatron model to an inference engine, in memory (docs/handoff.md).

`adapter_state(chunks, family)` returns the PEFT adapter (config and tensors under PEFT names)
gathered from its shards onto one rank; `stream` yields it one transformer layer at a time.
"""

from .state import AdapterState, adapter_state, stream

__all__ = ["AdapterState", "adapter_state", "stream"]
