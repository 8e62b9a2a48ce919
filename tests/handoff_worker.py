"""Rank-side code of the hand-off tests: `adapter_state` on a live model, with its traffic counted.

`Traffic` wraps torch.distributed's tensor primitives (in both namespaces, so the ones that
`all_gather_object` calls inside `distributed_c10d` are counted too) and records, per call, the
operation and the bytes of the tensors it moves; the parent compares them with the adapter's size.
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import persistence_worker
import torch

_OPERATIONS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce_scatter")


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


@contextlib.contextmanager
def traffic(calls: List[Tuple[str, int]]):
    """Record (operation, bytes of its first tensor argument) of every torch.distributed primitive called inside
    (not those a recorded one calls itself)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved, depth = [], [0]
    for name in _OPERATIONS:
        original = getattr(c10d, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            if not depth[0]:  # the outermost call only (`send` runs `isend`, `all_gather_object` `all_gather`)
                calls.append((_name, _bytes(args[0]) if args else 0))
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        for namespace in (dist, c10d):
            if getattr(namespace, name, None) is original:
                saved.append((namespace, name, original))
                setattr(namespace, name, counted)
    try:
        yield calls
    finally:
        for namespace, name, original in saved:
            setattr(namespace, name, original)


def state_world(rank: int, world: int, topology: str, spec, seed: int, directory: str, family: str,
                options=None, shared_experts: bool = False, peft_dir=None) -> dict:
    """Build with adapters of `seed` (`options`: more LoraConfig fields; `shared_experts`: with the shared
    experts of `hf_qwen2_moe`; `peft_dir`: then import that PEFT adapter), take `adapter_state` with its
    traffic counted, and the names `stream` yields per unit; then write an adapter-only checkpoint; full-vocab
    logits when there is one stage."""
    import hf_qwen2_moe

    from megatron_lora_patch import handoff
    from megatron_lora_patch.handoff import adapter_state
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.lora.exchange.transfer import import_peft
    from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(persistence_worker.lora_config(seed, **(options or {})))
    parsed = Topology.parse(topology)
    with parsed.world():
        chunks = build_model(spec, parsed, **(hf_qwen2_moe.build_options(spec, DEFAULT_SEED) if shared_experts else {}))
        if peft_dir is not None:
            import_peft(chunks, peft_dir)
        calls: List[Tuple[str, int]] = []
        with traffic(calls):
            state = adapter_state(chunks, family)
        units = [(unit, sorted(part)) for unit, part in handoff.stream(chunks, family)[1]]
        save_adapters(chunks, directory)
        logits = persistence_worker.full_logits(chunks[0], spec) if parsed.pp == 1 else None
        base_bytes = sum(_bytes(p) for name, p in chunks[0].named_parameters() if ".lora." not in name)
        return {"config": state.config, "tensors": state.tensors, "calls": calls, "logits": logits,
                "base_bytes": base_bytes, "units": units}


def train_state_world(rank: int, world: int, topology: str, spec, environ: dict, steps: int, directory: str,
                      family: str) -> dict:
    """The LoRA configuration parsed from the `MEGATRON_LORA_*` variables `environ` (as at plugin activation), the
    model with `hf_qwen2_moe`'s shared experts trained `steps` Adam steps (`resume_worker`'s loop); then its
    `adapter_state`, an adapter-only checkpoint in `directory` and full-vocab logits."""
    import hf_qwen2_moe
    import resume_worker
    from megatron.core.distributed import finalize_model_grads

    from megatron_lora_patch.handoff import adapter_state
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.proof.testbed import model_setup
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence_worker.setup(LoraConfig.from_env(environ), resume_worker.TRAINING_PATCHES)
    parsed, settings = Topology.parse(topology), resume_worker.SETTINGS
    with parsed.world(seed=settings.seed):
        model = build_model(spec, parsed, seed=settings.seed, **hf_qwen2_moe.build_options(spec, settings.seed))
        chunks = model_setup.wrap_like_get_model(model, settings)
        optimizer = model_setup.build_optimizer(chunks, settings)
        chunks[0].config.grad_scale_func = optimizer.scale_loss
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        for step in range(steps):
            resume_worker._train_step(chunks, optimizer, spec, step)
        state = adapter_state(chunks, family)
        save_adapters(chunks, directory)
        return {"config": state.config, "tensors": state.tensors,
                "logits": persistence_worker.full_logits(chunks[0].module, spec)}


def calls_world(rank: int, world: int, topology: str, spec, seed: int, calls) -> list:
    """Build the model with adapters of `seed`, then make this rank's hand-off `calls` in order: each
    (function name, keyword arguments, seconds to sleep first), or None for a call this rank skips. Per call
    (outcome, seconds it took): "ok" with the number of tensors this rank got, or the UsageError's message."""
    import time

    from rank_calls import make_calls

    return make_calls(rank, topology, spec, persistence_worker.lora_config(seed), calls, _hand_off,
                      prepare=lambda call: time.sleep(call[2]))


def _hand_off(chunks: list, call: tuple) -> str:
    from megatron_lora_patch import handoff

    function, options, _ = call
    if function == "stream":
        tensors = {key: value for _, part in handoff.stream(chunks, **options)[1] for key, value in part.items()}
    else:
        tensors = handoff.adapter_state(chunks, **options).tensors
    return f"ok {len(tensors)}"
