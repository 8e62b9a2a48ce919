"""Rank-side code of the persistence tests: tiny GPT models with adapters, saved / loaded / exported.

Ranks return their local adapter shards with where they sit (`local_adapters`); the
parent rebuilds the logical adapters with `assemble` (layouts.unshard: an independent
path from the checkpoint code) and compares them with `expected_logical`, the logical
init of `lora.init.logical_factors` (no world involved).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_lora_patch.lora.config import LoraConfig

PATCHES = ("cpu_compat", "lora_linear", "lora_checkpoint")


def lora_config(seed: int, rank: int = 4, **options) -> LoraConfig:
    """Non-zero B so a wrong slice of either factor changes values; `options`: more LoraConfig fields."""
    return LoraConfig(rank=rank, alpha=8.0, b_init="nonzero", seed=seed, **options)


def setup(config: LoraConfig, patches=PATCHES) -> None:
    """Only the given patches on (the persistence tests see no other); adapters from `config`."""
    from megatron_lora_patch.lora.config import set_active
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(patches)
    set_active(config)


def local_adapters(chunks) -> List[dict]:
    """Every local adapter's shard and position, as picklable data."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    from megatron_lora_patch.lora.inventory import adapters_of

    return [
        {
            "name": name,
            "mode": adapter.parallel_mode,
            "tp_rank": get_pg_rank(adapter.tp_group),
            "tp_size": get_pg_size(adapter.tp_group),
            "stride": getattr(adapter.B if adapter.parallel_mode == "column" else adapter.A, "partition_stride", 1),
            "A": adapter.A.detach().clone(),
            "B": adapter.B.detach().clone(),
        }
        for name, adapter in adapters_of(chunks).items()
    ]


def assemble(rank_results: List[List[dict]]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Logical (A, B) per module from all ranks' `local_adapters`; replicas must agree bitwise."""
    from megatron_lora_patch.lora.adapters.layouts import unshard

    by_name: Dict[str, Dict[int, dict]] = {}
    for entries in rank_results:
        for entry in entries:
            replicas = by_name.setdefault(entry["name"], {})
            if entry["tp_rank"] in replicas:
                seen = replicas[entry["tp_rank"]]
                assert torch.equal(seen["A"], entry["A"]) and torch.equal(seen["B"], entry["B"]), entry["name"]
            replicas[entry["tp_rank"]] = entry
    logical = {}
    for name, replicas in by_name.items():
        shards = [replicas[r] for r in range(len(replicas))]
        first = shards[0]
        assert len(shards) == first["tp_size"], f"{name}: got TP ranks {sorted(replicas)} of {first['tp_size']}"
        if first["mode"] == "column":
            for entry in shards[1:]:
                assert torch.equal(entry["A"], first["A"]), f"{name}: replicated A differs over TP"
            logical[name] = (first["A"], unshard([s["B"] for s in shards], 0, first["stride"]))
        else:
            for entry in shards[1:]:
                assert torch.equal(entry["B"], first["B"]), f"{name}: replicated B differs over TP"
            logical[name] = (unshard([s["A"] for s in shards], 1), first["B"])
    return logical


def adapter_names(spec) -> List[str]:
    """Every adapter the default targets attach to `spec`, named from the spec alone (never from a result)."""
    names = []
    for layer in range(spec.num_layers):
        prefix = f"decoder.layers.{layer}."
        mlps = [f"mlp.experts.local_experts.{e}." for e in range(spec.num_experts)] if spec.is_moe else ["mlp."]
        names += [prefix + "self_attention.linear_qkv", prefix + "self_attention.linear_proj"]
        names += [prefix + mlp + linear for mlp in mlps for linear in ("linear_fc1", "linear_fc2")]
    return names


def expected_logical(spec, config: LoraConfig) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """The logical init of every adapter of `spec`, from (seed, name, expert) alone."""
    from types import SimpleNamespace

    from megatron_lora_patch.lora.adapters.init import logical_factors
    from megatron_lora_patch.lora.adapters.projections import projection_rows

    hidden, kv = spec.hidden_size, spec.kv_channels
    fused = SimpleNamespace(
        kv_channels=kv,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True,
    )  # the testbed is SwiGLU
    sizes = {
        "linear_qkv": (hidden, (spec.num_attention_heads + 2 * spec.num_query_groups) * kv),
        "linear_proj": (spec.num_attention_heads * kv, hidden),
        "linear_fc1": (hidden, 2 * (spec.expert_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size)),
        "linear_fc2": (spec.expert_ffn_hidden_size if spec.is_moe else spec.ffn_hidden_size, hidden),
    }
    result = {}
    for name in adapter_names(spec):
        expert = int(name.split("local_experts.")[1].split(".")[0]) if "local_experts." in name else None
        in_size, out_size = sizes[name.rsplit(".", 1)[-1]]
        rows = projection_rows(name, fused, expert) if config.separate_projections else None
        result[name] = logical_factors(config, name, expert, in_size, out_size, rows)
    return result


def save_world(rank: int, world: int, topology: str, spec, seed: int, directory: str, patches=PATCHES) -> List[dict]:
    """Build with adapters of `seed`, write an adapter-only checkpoint; return the local adapters."""
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(seed), patches)
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        save_adapters(chunks, directory)
        return local_adapters(chunks)


def load_world(rank: int, world: int, topology: str, spec, directories: List[str], bad_rank_dir: Optional[str] = None):
    """Build with other adapters (seed 999), load each checkpoint; return local adapters per checkpoint.

    With `bad_rank_dir`, also load that checkpoint into rank-8 and into separate-projection adapters and
    return the two error texts.
    """
    from megatron_lora_patch.lora.checkpoints.checkpoint import load_adapters
    from megatron_lora_patch.lora.config import set_active
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(999))
    loaded, error = [], None
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        for directory in directories:
            load_adapters(chunks, directory)
            loaded.append(local_adapters(chunks))
        if bad_rank_dir is not None:  # another rank, then separate q/k/v adapters: one line each
            error = []
            for config in (lora_config(999, rank=8), lora_config(999, separate_projections=True)):
                set_active(config)
                other = build_model(spec, Topology.parse(topology))
                try:
                    load_adapters(other, bad_rank_dir)
                except ValueError as problem:
                    error.append(str(problem))
    return loaded, error


def batch(spec, batch_size: int = 2):
    """Fixed tokens and positions for logits comparisons."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (batch_size, spec.seq_length), generator=generator)
    return tokens, torch.arange(spec.seq_length).unsqueeze(0).expand(batch_size, -1)


def full_logits(model, spec) -> torch.Tensor:
    """Full-vocab logits [b, s, V] from the vocab-parallel output of a single-stage model."""
    from megatron.core import parallel_state

    with torch.no_grad():
        logits = model(*batch(spec), None)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def export_and_merge_world(rank: int, world: int, topology: str, spec, seed: int, directory: str, options=None) -> dict:
    """Logits with adapters, an adapter-only checkpoint, then logits merged / unmerged and the weight drift
    (`options`: LoraConfig fields beyond the defaults, e.g. rsLoRA and rank / alpha patterns)."""
    from megatron_lora_patch.lora.adapters.merge import merge_adapters, unmerge_adapters
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(seed, **(options or {})))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        model = chunks[0]
        adapted = full_logits(model, spec)
        save_adapters(chunks, directory)
        weights = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora." not in name}
        merged = merge_adapters(chunks)
        merged_logits = full_logits(model, spec)
        unmerge_adapters(merged)
        drift = max(
            (p.detach() - weights[name]).abs().max().item() for name, p in model.named_parameters() if name in weights
        )
        return {
            "adapted": adapted,
            "merged": merged_logits,
            "unmerged": full_logits(model, spec),
            "merged_count": len(merged),
            "weight_drift": drift,
        }


def import_and_save_world(
    rank: int, world: int, topology: str, spec, peft_dir: str, directory: str, options=None
) -> List[dict]:
    """Import a PEFT adapter into fresh adapters (another seed; `options` as when exported) and write an adapter-only
    checkpoint."""
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.lora.exchange.transfer import import_peft
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(999, **(options or {})))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        import_peft(chunks, peft_dir)
        save_adapters(chunks, directory)
        return local_adapters(chunks)


def _tree_bytes(directory: str) -> Dict[str, bytes]:
    import os

    files = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, directory)] = handle.read()
    return files


def overwrite_world(rank: int, world: int, topology: str, spec, seed: int, root: str) -> dict:
    """A base-model checkpoint and adapter checkpoints in `root`, then `save_adapters` over non-empty targets.

    `root/base`: the model without adapters, which `save_adapters` must refuse to overwrite
    (its bytes before and after are returned); `root/adapters`: the adapters of `seed`;
    `root/replaced`: first those adapters, then replaced (`overwrite=True`) by them with B doubled.
    """
    import os

    from megatron.core import dist_checkpointing

    from megatron_lora_patch.lora.checkpoints.checkpoint import is_adapter_key, save_adapters
    from megatron_lora_patch.lora.inventory import adapters_of
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime.errors import UsageError

    setup(lora_config(seed))
    paths = {name: os.path.join(root, name) for name in ("base", "adapters", "replaced")}
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        base = {key: value for key, value in chunks[0].sharded_state_dict().items() if not is_adapter_key(key)}
        os.makedirs(paths["base"], exist_ok=True)
        dist_checkpointing.save(base, paths["base"])
        before = _tree_bytes(paths["base"])
        try:
            save_adapters(chunks, paths["base"])
            refusal = None
        except UsageError as error:
            refusal = str(error)
        save_adapters(chunks, paths["adapters"])
        save_adapters(chunks, paths["replaced"])
        with torch.no_grad():
            for adapter in adapters_of(chunks).values():
                adapter.B.mul_(2)
        save_adapters(chunks, paths["replaced"], overwrite=True)
        return {"refusal": refusal, "base_before": before, "base_after": _tree_bytes(paths["base"]), "paths": paths}


def damaged_load_world(rank: int, world: int, topology: str, spec, directories: List[str]) -> List[str]:
    """Build, then `load_adapters` each of `directories`: per directory "loaded" or the one-line UsageError."""
    from megatron_lora_patch.lora.checkpoints.checkpoint import load_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.runtime.errors import UsageError

    setup(lora_config(999))
    outcomes = []
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        for directory in directories:
            try:
                load_adapters(chunks, directory)
                outcomes.append("loaded")
            except UsageError as error:
                outcomes.append(str(error))
    return outcomes
