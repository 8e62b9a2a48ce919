"""The layout-invariant mode never materialises a full (unsharded) base weight (docs/architecture.md section 7).

Real Megatron training steps (DDP, finalize, Adam with clipping: forward, backward and optimizer
step) of the tiny GPT with LoRA at TP 2 (with SP) and TP 4. In every rank, each all-gather that
torch.distributed runs (`all_gather`, `all_gather_into_tensor`, `_all_gather_base`: every
collective that assembles a larger tensor from per-rank pieces, Megatron's and this package's)
is recorded with its local piece. Two independent checks:

- by content: no piece is a base weight's local shard (shares its storage or equals it);
- by size: every assembled tensor (world x piece) is smaller than the smallest full base weight
  of the model (hidden 128: the activation-sized tree partials and the adapter-sized grads are
  smaller than any weight; the figure is printed).

Gathers do happen (the tree combines of column backward and row forward at least). Negative
control: the same run with one full weight gathered per row layer call (what the mode's former
weight cache did) fails both checks. Under Megatron's activation checkpointing the recompute gives
the same grads as the plain pass, bit for bit (the layers keep no state between the passes).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.patches.layout_invariant import SPEC
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.runtime import versions

_OUT_OF_RANGE = versions.out_of_range_reason(SPEC.name, SPEC.versions, versions.installed_megatron_core())
pytestmark = pytest.mark.skipif(bool(_OUT_OF_RANGE), reason=f"tp_invariant does not apply here: {_OUT_OF_RANGE}")

PATCHES = {"cpu_compat", "lora_linear", "finalize_grads", "loss_normalization", "layout_invariant"}
GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base")
#: (local piece, world size) of every all-gather this rank ran.
_PIECES: list = []


def _spec():
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    return TinyGPTSpec(hidden_size=128, ffn_hidden_size=256, num_attention_heads=8, num_query_groups=4)


def _recording(name: str, original):
    def gather(output, tensor, *args, **kwargs):
        group = kwargs.get("group", args[0] if args else None)
        _PIECES.append((tensor.detach(), torch.distributed.get_world_size(group)))
        return original(output, tensor, *args, **kwargs)

    return gather


def _gather_a_weight(original):
    """Negative control: the row layer all-gathers its full base weight first (as the former cache did)."""
    from megatron_lora_patch.layout_invariant.tensor_parallel.collectives import all_gather_logical

    def row_linear(x, weight, lora, group):
        all_gather_logical(weight.detach(), 1, 1, group)
        return original(x, weight, lora, group)

    return row_linear


def _train(rank, world_size, topology_text, gather_weight):
    from megatron_lora_patch.layout_invariant.tensor_parallel import segmented
    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed.driver import train_steps
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.settings import TrainSettings
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_only(PATCHES, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    for name in GATHERS:
        setattr(torch.distributed, name, _recording(name, getattr(torch.distributed, name)))
    if gather_weight:
        segmented.row_linear = _gather_a_weight(segmented.row_linear)
    weights = []

    def remember(chunks):  # the frozen, sharded base weights of every linear layer
        weights.extend(param for name, param in chunks[0].named_parameters()
                       if ".lora." not in name and param.dim() == 2 and getattr(param, "tensor_model_parallel", False))

    settings = TrainSettings(steps=2, global_batch_size=2, on_model_built=remember)
    topology = Topology.parse(topology_text)
    with topology.world(seed=settings.seed):
        train_steps(_spec(), topology, settings)
    carries = sum(any(piece.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
                      or (piece.shape == weight.shape and torch.equal(piece, weight)) for weight in weights)
                  for piece, _ in _PIECES)
    return {"gathers": len(_PIECES), "carrying_a_weight": carries,
            "largest_gathered": max(piece.numel() * world for piece, world in _PIECES),
            "smallest_full_weight": min(weight.numel() * world_size for weight in weights)}


def run(topology_text: str, gather_weight: bool = False) -> list:
    from megatron_lora_patch.proof.testbed.topology import Topology

    world_size = Topology.parse(topology_text).world_size
    return run_world(_train, world_size, args=(topology_text, gather_weight), timeout=600, name=topology_text)


@pytest.mark.parametrize("topology", ["tp2-sp", "tp4"])
def test_no_full_base_weight_is_gathered(topology):
    for record in run(topology):
        print(f"{topology}: {record}")
        assert record["gathers"] > 0
        assert record["carrying_a_weight"] == 0
        assert record["largest_gathered"] < record["smallest_full_weight"]


def test_the_checks_see_a_gathered_weight():
    """Negative control: one full weight gathered per row layer call is caught by both checks."""
    for record in run("tp2", gather_weight=True):
        assert record["carrying_a_weight"] > 0
        assert record["largest_gathered"] >= record["smallest_full_weight"]


def _recompute(rank, world_size):
    """LoRA grads of one microbatch, plainly and under Megatron's activation checkpointing."""
    from megatron.core import tensor_parallel

    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed import data
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, build_model
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_only(PATCHES, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    spec = TinyGPTSpec()
    with Topology.parse("tp2").world(seed=1234):
        model = build_model(spec, Topology.parse("tp2"))[0]
        batch = data.make_global_batch(1234, 2, spec.seq_length, spec.vocab_size)

        def loss(anchor, tokens, positions, labels):
            return model(tokens, positions, None, labels=labels).sum() + anchor

        anchor = torch.zeros((), requires_grad=True)  # Megatron's checkpoint needs an input that requires grad
        grads = []
        for checkpointed in (False, True):
            model.zero_grad()
            args = (anchor, batch["tokens"], batch["position_ids"], batch["labels"])
            (tensor_parallel.checkpoint(loss, False, *args) if checkpointed else loss(*args)).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        return grads


def test_recompute_gives_the_same_grads():
    plain, recomputed = run_world(_recompute, 2, timeout=300, name="tp2 recompute")[0]
    assert plain and plain.keys() == recomputed.keys()
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)
