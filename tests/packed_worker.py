"""The rank side of tests/test_packed_data.py: the testbed's packed (THD) core attention on this CP rank's
per-sequence share of a seeded packed row, forward and backward, returned for the parent to assemble."""

from __future__ import annotations

import torch

#: Sequence boundaries of the packed row: unequal lengths, each divisible by 2 * cp for cp <= 2.
CU_SEQLENS = (0, 4, 8, 20, 24)
HEADS, GROUPS, DIM = 4, 2, 16


def packed_inputs(seed: int) -> dict:
    """Global q [T, heads, dim], k / v [T, groups, dim] and the output weights [T, 1, heads * dim]."""
    generator = torch.Generator().manual_seed(seed)
    total = CU_SEQLENS[-1]
    return {
        "query": torch.randn(total, HEADS, DIM, generator=generator),
        "key": torch.randn(total, GROUPS, DIM, generator=generator),
        "value": torch.randn(total, GROUPS, DIM, generator=generator),
        "weight": torch.randn(total, 1, HEADS * DIM, generator=generator),
    }


def _data_splits(seed: int) -> tuple:
    """This CP rank's share of a packed microbatch: the testbed's (Megatron's own where it splits per
    sequence) and TE's definition applied directly."""
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed import data, packing

    batch = data.dp_rank_microbatches(packing.make_packed_global_batch(seed, 2, 16, 128), 0, 1, 1)[1]
    return data.packed_cp_rank_slice(batch), data.thd_split(batch, parallel_state.get_context_parallel_group())


def packed_attention_rank(rank: int, world_size: int, seed: int) -> dict:
    """This CP rank's indices, attention output and q / k / v grads of sum(output * weight)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_lora_patch.cpu_testbed.thd import thd_get_partitioned_indices
    from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, transformer_config
    from megatron_lora_patch.proof.testbed.topology import Topology

    topology = Topology.parse(f"cp{world_size}" if world_size > 1 else "tp1")
    spec = TinyGPTSpec(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=24)
    with topology.world(seed=seed):
        config = transformer_config(spec, topology)
        attention = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")
        cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
        index = thd_get_partitioned_indices(cu_seqlens, CU_SEQLENS[-1], world_size, rank).long()
        inputs = packed_inputs(seed)
        local = {name: inputs[name][index].clone().requires_grad_() for name in ("query", "key", "value")}
        longest = max(b - a for a, b in zip(CU_SEQLENS, CU_SEQLENS[1:]))
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        output = attention(local["query"], local["key"], local["value"], None, packed_seq_params=params)
        (output * inputs["weight"][index]).sum().backward()
        try:
            attention(local["query"], local["key"], local["value"], None, packed_seq_params=PackedSeqParams("bshd"))
            refusal = None
        except ValueError as error:
            refusal = str(error)
        return {
            "refusal": refusal,
            "splits": _data_splits(seed),
            "index": index,
            "output": output.detach(),
            "grads": {name: tensor.grad for name, tensor in local.items()},
        }
