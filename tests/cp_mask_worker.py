"""The rank side of tests/test_cp_attention.py's masked check: the testbed's CP core attention on this CP rank's
query rows of a seeded batch whose `[b, 1, s, s]` attention mask restarts attention at document boundaries (what
GPTDataset builds with `--reset-attention-mask`), cut on its query dim as `get_batch_on_this_cp_rank` cuts it."""

from __future__ import annotations

import torch

#: Per sample: where its documents start (not at CP chunk boundaries, as GPTDataset packs them).
DOCUMENT_STARTS = ((0, 5, 13), (0, 9, 10))
SEQ, HEADS, GROUPS, DIM = 24, 4, 2, 16


def document_mask() -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked: a key after the query or in another document."""
    positions = torch.arange(SEQ)
    masks = []
    for starts in DOCUMENT_STARTS:
        document = torch.bucketize(positions, torch.tensor(starts[1:]), right=True)
        allowed = (document.unsqueeze(1) == document.unsqueeze(0)) & (positions.unsqueeze(0) <= positions.unsqueeze(1))
        masks.append(~allowed)
    return torch.stack(masks).unsqueeze(1)


def masked_inputs(seed: int) -> dict:
    """Global q [s, b, heads, dim], k / v [s, b, groups, dim] and the output weights [s, b, heads * dim]."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(DOCUMENT_STARTS)
    return {
        "query": torch.randn(SEQ, batch, HEADS, DIM, generator=generator),
        "key": torch.randn(SEQ, batch, GROUPS, DIM, generator=generator),
        "value": torch.randn(SEQ, batch, GROUPS, DIM, generator=generator),
        "weight": torch.randn(SEQ, batch, HEADS * DIM, generator=generator),
    }


def masked_attention_rank(rank: int, world_size: int, seed: int) -> dict:
    """This CP rank's query positions, attention output and q / k / v grads of sum(output * weight), with the
    document mask; and the output with no mask given (causal only: what ignoring the mask computes)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention, cp_chunk_positions
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, transformer_config
    from megatron_lora_patch.proof.testbed.topology import Topology

    topology = Topology.parse(f"cp{world_size}")
    spec = TinyGPTSpec(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=SEQ)
    with topology.world(seed=seed):
        config = transformer_config(spec, topology)
        attention = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")
        positions = cp_chunk_positions(SEQ, world_size, rank)
        inputs = masked_inputs(seed)
        local = {name: inputs[name][positions].clone().requires_grad_() for name in ("query", "key", "value")}
        mask = document_mask()[:, :, positions, :]  # the query dim, as get_batch_on_this_cp_rank cuts it
        output = attention(local["query"], local["key"], local["value"], mask)
        (output * inputs["weight"][positions]).sum().backward()
        with torch.no_grad():
            unmasked = attention(local["query"], local["key"], local["value"], None)
        return {
            "positions": positions,
            "output": output.detach(),
            "unmasked": unmasked,
            "grads": {name: tensor.grad for name, tensor in local.items()},
        }
