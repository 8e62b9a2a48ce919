"""Forward outputs of adapted modules, from every rank back to the world-1 layout.

Parameters are canonicalized by `testbed.shards` (TP / expert shards, PP layer numbers,
EP expert indices); this module does the same for activations, from the layout each
rank records about itself (`rank_layout`):
- features: a column-parallel output is sharded over TP on its last dim (a SwiGLU fc1
  output as [gate_shard; up_shard]); a row-parallel output is complete;
- sequence: CP ranks hold Megatron's load-balanced chunks (their global positions are
  recorded); under sequence parallelism a row-parallel output is further cut over TP;
- microbatches: microbatch m of DP rank r is global microbatch m*dp + r;
- pipeline: a module lives on one stage only, under its global layer index.
Expert linears are not compared here: which tokens reach an expert depends on routing
and dispatch; their effect is compared through losses, grads and deltas. The routers'
decisions are canonicalized the same way (a router sees the tokens a row-parallel output
holds) and must equal world-1's exactly: a flipped top-k choice would make every later
comparison meaningless, so the harness fails the topology loudly instead.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_lora_patch.proof.testbed.shards import Shard

LINEAR, ROUTING = "linear", "routing"


def is_adapted_dense_linear(module: torch.nn.Module) -> bool:
    """A non-expert parallel linear that carries a LoRA adapter."""
    from megatron_lora_patch.lora.layers.linear import adapter_of

    return adapter_of(module) is not None and not getattr(module, "is_expert", False)


def _is_router(module: torch.nn.Module) -> bool:
    from megatron.core.transformer.moe.router import TopKRouter

    return isinstance(module, TopKRouter)


def is_captured(name: str, module: torch.nn.Module) -> bool:
    """Forward-capture predicate: adapted dense linears and MoE routers."""
    return is_adapted_dense_linear(module) or _is_router(module)


def rank_layout(model: torch.nn.Module, seq_length: int, micro_batch_size: int, cu_seqlens=None) -> dict:
    """What the parent needs to place this rank's forward captures (recorded in the rank); `cu_seqlens`
    `[1, n + 1]`: the rows are packed so, and CP splits each sequence."""
    from megatron_lora_patch.lora.layers.attach import canonical_modules
    from megatron_lora_patch.lora.layers.linear import adapter_of
    from megatron_lora_patch.proof.testbed.data import cp_sequence_positions

    canonical = {id(module): name for name, _, module, _ in canonical_modules(model)}
    modules = {}
    for name, module in model.named_modules():
        if is_adapted_dense_linear(module):
            adapter = adapter_of(module)
            gated = getattr(adapter.B, "partition_stride", 1) == 2
            modules[name] = {"name": adapter.module_name, "mode": adapter.parallel_mode, "gated": gated, "kind": LINEAR}
        elif _is_router(module):  # routers see the tokens a row-parallel output holds
            modules[name] = {"name": canonical[id(module)], "mode": "row", "gated": False, "kind": ROUTING}
    return {
        "modules": modules,
        "sequence_parallel": bool(model.config.sequence_parallel),
        "cp_positions": cp_sequence_positions(seq_length, cu_seqlens).tolist(),
        "micro_batch_size": micro_batch_size,
    }


def expert_biases(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """`{"<router>.expert_bias": tensor}` of this rank's routers that keep DeepSeek's aux-loss-free expert bias.

    The bias is a base buffer, not a LoRA parameter, yet it changes every step (Megatron's
    `finalize_model_grads` moves it from the tokens per expert counted over TP x DP x CP); every rank of a
    stage holds the whole vector."""
    from megatron_lora_patch.lora.layers.attach import canonical_modules

    canonical = {id(module): name for name, _, module, _ in canonical_modules(model)}
    return {
        f"{canonical[id(module)]}.expert_bias": module.expert_bias.detach().float().cpu().clone()
        for module in model.modules()
        if _is_router(module) and getattr(module, "expert_bias", None) is not None
    }


def agreed_expert_biases(records: List[dict]) -> Dict[str, torch.Tensor]:
    """`{"step<j>/<router>.expert_bias": tensor}` after each step, in world-1 layout: the ranks' copies where
    they agree; where they do not (a layout-dependent update), their mean, which then differs from world-1's."""
    copies: Dict[str, list] = {}
    for record in records:
        for step, entry in enumerate(record["steps"]):
            for name, bias in entry["extra"].get("expert_bias", {}).items():
                copies.setdefault(f"step{step}/{name}", []).append(bias)
    return {
        key: tensors[0] if all(torch.equal(tensor, tensors[0]) for tensor in tensors) else torch.stack(tensors).mean(0)
        for key, tensors in copies.items()
    }


def forward_outputs(records: List[dict], step: int = 0, kind: str = LINEAR) -> Dict[str, torch.Tensor]:
    """`{"<module>@mb<global microbatch>": [seq, batch, features] tensor}` of step `step`:
    adapted linears' outputs (`kind="linear"`) or routers' routing maps (`kind="routing"`).

    Raises if some element of an output came from no rank (a canonicalization bug must
    not compare a partial tensor).
    """
    pieces: Dict[str, list] = {}
    for record in records:
        layout, coords = record["steps"][0]["extra"]["layout"], record["coords"]
        for local_name, outputs in record["steps"][step]["forward"].items():
            module = layout["modules"][local_name]
            if module["kind"] != kind:
                continue
            for local_index, output in enumerate(outputs):
                if kind == ROUTING:  # (probs, routing_map [tokens, experts]) in [seq, batch] token order
                    routing_map = output[1]
                    tensor = routing_map.reshape(-1, layout["micro_batch_size"], routing_map.shape[-1])
                else:
                    tensor = output[0] if isinstance(output, (tuple, list)) else output
                key = f"{module['name']}@mb{local_index * coords['dp_size'] + coords['dp_rank']}"
                pieces.setdefault(key, []).append(_placement(tensor.float(), module, layout, coords))
    return {key: _assemble(parts, key) for key, parts in pieces.items()}


def routing_divergence(candidate: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> str:
    """'' when every routing decision equals the reference; otherwise where and how many tokens differ."""
    if set(candidate) != set(reference):
        return f"routing maps captured for {sorted(candidate)} but the reference has {sorted(reference)}"
    diverged = {key: int((candidate[key] != reference[key]).any(-1).sum()) for key in reference}
    diverged = {key: tokens for key, tokens in diverged.items() if tokens}
    if not diverged:
        return ""
    where = ", ".join(f"{key} ({tokens} tokens)" for key, tokens in sorted(diverged.items()))
    return f"MoE routing diverged from world-1, so no comparison is meaningful: {where}"


def _placement(tensor: torch.Tensor, module: dict, layout: dict, coords: dict):
    """(global sequence positions, feature Shard, full feature size, local tensor)."""
    positions = torch.tensor(layout["cp_positions"])
    tp_rank, tp_size = coords["tp_rank"], coords["tp_size"]
    if module["mode"] == "row" and layout["sequence_parallel"]:
        share = len(positions) // tp_size
        positions = positions[tp_rank * share : (tp_rank + 1) * share]
    if module["mode"] == "column":
        features = Shard(module["name"], partition_dim=2, rank=tp_rank, size=tp_size, gated=module["gated"])
        full_features = tensor.shape[-1] * tp_size
    else:
        features, full_features = Shard(module["name"]), tensor.shape[-1]
    if tensor.shape[0] != len(positions):
        raise ValueError(f"{module['name']}: {tensor.shape[0]} local positions, layout says {len(positions)}")
    return positions, features, full_features, tensor


def _assemble(parts: list, key: str) -> torch.Tensor:
    seq_length = max(int(positions.max()) for positions, *_ in parts) + 1
    _, _, full_features, first = parts[0]
    full = torch.zeros(seq_length, first.shape[1], full_features)
    covered = torch.zeros_like(full, dtype=torch.bool)
    for positions, features, _, tensor in parts:
        rows, seen = full[positions], covered[positions]
        features.place(rows, tensor)
        features.place(seen, torch.ones_like(tensor, dtype=torch.bool))
        full[positions], covered[positions] = rows, seen
    if not bool(covered.all()):
        raise ValueError(f"forward output {key}: {int((~covered).sum())} elements came from no rank")
    return full
