"""Adapters from a live Megatron model to an inference engine, in memory (docs/handoff.md).

`adapter_state(chunks, family)` returns the PEFT adapter (config and tensors under PEFT names)
gathered from its shards onto one rank; `stream` yields it one transformer layer at a time;
`convert` rewrites its MoE experts into the layouts servers load; `sglang_payload` / `vllm_payload`
are the arguments of each engine's load-from-tensors path.
"""

from megatron_lora_patch.handoff.engines import EngineError, sglang_payload, vllm_payload
from megatron_lora_patch.handoff.moe_layouts import LayoutError, convert
from megatron_lora_patch.handoff.state import AdapterState, adapter_state, stream

__all__ = ["AdapterState", "EngineError", "LayoutError", "adapter_state", "convert", "sglang_payload", "stream",
           "vllm_payload"]
