"""The size of the user's scaled model, and the cuts that make it fit the preflight's budget.

`estimate_parameters` counts the world-size-1 reference's weights (GQA or multi-latent attention, dense MLP,
routed and shared experts, embeddings). `cut_to_fit` keeps the model's STRUCTURE (attention kind and its
latent ranks' roles, the router, group-limited top-k, scaling, shared expert, one layer of each kind, the
user's parallel layout) and cuts what must be cut, in this order and each only as far as needed to fit the
budget: (1) depth (`ArgsModelSpec.from_args` already keeps the fewest layers), (2) the number of routed
experts (kept divisible by the router groups and the EP size, at least top-k, and enough in the chosen
groups for top-k), (3) the vocabulary (mock data only: real tokens need the user's vocabulary), (4) every
width by one common factor, to a floor. What was cut is `spec.cuts`: (option, the user's value, the value run).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any, Iterator

#: The narrowest a width is cut to, and the smallest vocabulary the cut keeps.
WIDTH_FLOOR = 8
VOCAB_FLOOR = 256
#: Widths cut by the common factor (argument names; head counts are cut apart, kept divisible by TP); the
#: attention's head widths: multi-latent attention's ranks and head dims, or GQA's kv channels.
WIDTHS = ("hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
GQA_WIDTHS = ("kv_channels",)
HEADS = ("num_attention_heads", "num_query_groups")
CUT_FIELDS = ("num_experts", "vocab_size", *WIDTHS, *MLA_WIDTHS, *GQA_WIDTHS, *HEADS)


def estimate_parameters(spec: Any) -> int:
    """Parameters of the scaled world-size-1 model (an estimate: biases and norms left out)."""
    args = spec.args
    hidden = args.hidden_size
    glu = 2 if args.swiglu or args.quick_geglu else 1

    def mlp(ffn: int) -> int:
        return hidden * ffn * glu + ffn * hidden

    attention = _attention_parameters(args)
    experts = 0
    if args.num_experts:
        experts = args.num_experts * (mlp(args.moe_ffn_hidden_size or args.ffn_hidden_size) + hidden)
        experts += mlp(args.moe_shared_expert_intermediate_size or 0)
    # A GPT layer is attention + MLP or MoE; a hybrid layer is one of them (args_hybrid.KINDS).
    parts = {"dense": attention + mlp(args.ffn_hidden_size), "moe": attention + experts}
    if spec.hybrid_pattern:
        parts = {"attention": attention, "mlp": mlp(args.ffn_hidden_size), "moe": experts}
    total = spec.padded_vocab_size * hidden * (2 if args.untie_embeddings_and_output_weights else 1)
    return total + sum(parts[kind] for kind in spec.kinds)


def _attention_parameters(args: Any) -> int:
    """One attention layer's projections: GQA's qkv + proj, or multi-latent attention's down / up projections."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    if getattr(args, "multi_latent_attention", False):
        qk = args.qk_head_dim + args.qk_pos_emb_head_dim
        q_rank = args.q_lora_rank
        query = hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
        key_value = hidden * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
        key_value += args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
        return query + key_value + heads * args.v_head_dim * hidden
    kv = args.kv_channels or hidden // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    return hidden * (heads + 2 * groups) * kv + heads * kv * hidden


def cut_to_fit(spec: Any, budget: int, topology: Any, cut_vocab: bool, rank: int) -> Any:
    """`spec` with experts, vocabulary (if `cut_vocab`) and widths cut in that order, each only as far as
    `budget` parameters need (or to its floor); unchanged if it fits. Widths stay at least the LoRA `rank`
    (an adapter's rank cannot exceed its linear). The caller checks memory afterwards."""
    user = spec.args
    steps = [_expert_cuts, _vocab_cuts if cut_vocab else None, functools.partial(_width_cuts, rank=rank)]
    for candidates in filter(None, steps):
        if estimate_parameters(spec) <= budget:
            break
        specs = list(candidates(spec, topology))
        spec = next((each for each in specs if estimate_parameters(each) <= budget), specs[-1] if specs else spec)
    cuts = tuple(
        (f"--{name.replace('_', '-')}", getattr(user, name, None), getattr(spec.args, name, None))
        for name in CUT_FIELDS
        if getattr(user, name, None) != getattr(spec.args, name, None)
    )
    return dataclasses.replace(spec, cuts=cuts) if cuts else spec


def _with(spec: Any, **values: Any) -> Any:
    """`spec` with these Megatron arguments changed (the padded vocabulary follows `vocab_size`)."""
    from megatron_lora_patch.proof.testbed.args_model import padded_vocab_size

    args = copy.copy(spec.args)
    for name, value in values.items():
        setattr(args, name, value)
    vocab, padded = padded_vocab_size(args) if "vocab_size" in values else (spec.vocab_size, spec.padded_vocab_size)
    return dataclasses.replace(spec, args=args, vocab_size=vocab, padded_vocab_size=padded)


def _expert_cuts(spec: Any, topology: Any) -> Iterator[Any]:
    """Fewer routed experts, most first: divisible by the router groups and EP, at least top-k, and the
    group-limited top-k still able to pick top-k experts from its chosen groups."""
    args = spec.args
    if not args.num_experts:
        return
    groups = args.moe_router_num_groups or 1
    chosen = args.moe_router_group_topk or groups
    step = math.lcm(groups, getattr(topology, "ep", 1))
    topk = args.moe_router_topk
    for experts in range(args.num_experts - args.num_experts % step, 0, -step):
        if topk <= experts < args.num_experts and experts // groups * chosen >= topk:
            yield _with(spec, num_experts=experts)


def _vocab_cuts(spec: Any, topology: Any) -> Iterator[Any]:
    """Smaller vocabularies, largest first, in steps of Megatron's padding multiple, down to VOCAB_FLOOR."""
    multiple = spec.args.make_vocab_size_divisible_by * getattr(topology, "tp", 1)
    floor = max(VOCAB_FLOOR, multiple)
    for vocab in range(spec.padded_vocab_size - multiple, floor - 1, -multiple):
        if vocab < spec.vocab_size:
            yield _with(spec, vocab_size=vocab)


def _width_cuts(spec: Any, topology: Any, rank: int) -> Iterator[Any]:
    """Every width divided by one common factor 2, 3, ... (rounded down to a multiple of TP, expert TP and 2,
    at least WIDTH_FLOOR and the LoRA rank), heads and query groups divided alike, kept multiples of TP and
    the groups dividing the heads (factors that break this are skipped)."""
    args, tp = spec.args, getattr(topology, "tp", 1)
    multiple = math.lcm(2, tp, getattr(topology, "etp", 1))
    floor = math.ceil(max(WIDTH_FLOOR, rank) / multiple) * multiple
    names = WIDTHS + (MLA_WIDTHS if getattr(args, "multi_latent_attention", False) else GQA_WIDTHS)
    widths = {name: getattr(args, name) for name in names if getattr(args, name, None)}
    heads = {name: getattr(args, name, None) for name in HEADS if getattr(args, name, None)}
    for factor in range(2, max(widths.values()) // WIDTH_FLOOR + 2):
        values = {name: max(floor, width // factor // multiple * multiple) for name, width in widths.items()}
        values |= {name: max(tp, count // factor // tp * tp) for name, count in heads.items()}
        if values.get("num_attention_heads", 1) % values.get("num_query_groups", 1) == 0:
            yield _with(spec, **values)
