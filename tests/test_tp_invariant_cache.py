"""`tp_invariant` gathers each full weight once and re-gathers it exactly when its shards change.

Real Megatron training steps (DDP, finalize, Adam with clipping) of the tiny GPT with LoRA, as
in tests/test_tp_invariant.py. After every optimizer step a weight is rewritten in one of the
ways training code rewrites weights; the TP = 2 run must stay BITWISE equal to the TP = 1 run
that does the same (at TP = 1 nothing is cached, so it always sees the write):

- the frozen base weight reloaded through `load_state_dict` (what a checkpoint load does);
- a LoRA factor written through `.data` after the step (version counter untouched).

Negative control: a base weight written through `.data` (documented as unseen) leaves TP = 2 on
a stale weight, and the same comparison then finds loss differences far above zero. Gather
counts: over STEPS steps each frozen weight is gathered once, each factor once per step (not
per microbatch), and the real optimizer step advances the cache's step.

Under Megatron's activation checkpointing the recompute reuses the gathered weights (each
tensor gathered once; negative control: clearing the cache in the recompute makes it twice)
and gives the same grads as the plain pass, bit for bit.

The mixed-precision optimizer writes the model params only through `.data` (no version bump),
which the fp32 CPU testbed cannot run; `test_untracked_factor_write_seen_after_a_step` checks
that case on the cache itself, with its stale negative control.
"""

from __future__ import annotations

import collections

import pytest
import torch

from megatron_lora_patch.patches.layout_invariant import SPEC
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.runtime import versions

_OUT_OF_RANGE = versions.out_of_range_reason(SPEC.name, SPEC.versions, versions.installed_megatron_core())
pytestmark = pytest.mark.skipif(bool(_OUT_OF_RANGE), reason=f"tp_invariant does not apply here: {_OUT_OF_RANGE}")

STEPS = 3
PATCHES = {"cpu_compat", "lora_linear", "finalize_grads", "loss_normalization", "tp_invariant"}
#: The rewritten layer: a row-parallel base (weight sharded along K) with a sharded A.
LAYER = "decoder.layers.0.mlp.linear_fc2"
#: Gathers per tensor, by storage pointer (filled in the rank by the counting wrapper).
_GATHERS: collections.Counter = collections.Counter()


def _reload_base(layer) -> None:
    layer.load_state_dict({"weight": layer.weight.detach() * 1.5}, strict=False)


def _write_base_data(layer) -> None:
    layer.weight.data.mul_(1.5)


def _write_factor_data(layer) -> None:
    layer.lora.A.data.mul_(1.5)


WRITES = {"reload_base": _reload_base, "base_data": _write_base_data, "factor_data": _write_factor_data}


def _counting_gather(original):
    def gather(tensor, dim, stride, group):
        _GATHERS[tensor.data_ptr()] += 1
        return original(tensor, dim, stride, group)

    return gather


def _train(rank, world_size, spec, topology_text, write):
    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed.driver import Capture, TrainSettings, train_steps
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.tp_invariant import cache

    apply_only(PATCHES, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    cache.all_gather_logical = _counting_gather(cache.all_gather_logical)
    built = {}

    def remember(chunks):  # the bare model, before DDP wraps it
        built["layer"] = chunks[0].get_submodule(LAYER)
        built["names"] = {param.data_ptr(): name for name, param in chunks[0].named_parameters()}

    def after_step(step, record, chunks):
        record["extra"]["cache_step"] = cache._step
        WRITES[write](built["layer"])

    settings = TrainSettings(steps=STEPS, global_batch_size=4, on_model_built=remember,
                             capture=Capture(on_step_end=after_step))
    topology = Topology.parse(topology_text)
    with topology.world(seed=settings.seed):
        record = train_steps(spec, topology, settings)
    names = built["names"]
    record["gathers"] = {names[pointer]: count for pointer, count in _GATHERS.items() if pointer in names}
    return record


def run(topology_text: str, write: str) -> list:
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
    from megatron_lora_patch.proof.testbed.topology import Topology

    world_size = Topology.parse(topology_text).world_size
    args = (TinyGPTSpec(), topology_text, write)
    return run_world(_train, world_size, args=args, timeout=600, name=f"{topology_text} {write}")


def loss_gap(reference: list, records: list) -> float:
    """Largest relative difference of any microbatch loss of any rank from the TP = 1 run."""
    gap = 0.0
    for record in records:
        for want, got in zip(reference[0]["steps"], record["steps"]):
            for expected, actual in zip(want["microbatches"], got["microbatches"]):
                for key in ("loss_sum", "loss_mean"):
                    if key in expected:
                        gap = max(gap, abs(actual[key] - expected[key]) / max(abs(expected[key]), 1e-30))
    return gap


def test_base_reload_is_seen_and_each_weight_gathered_once_per_change():
    records = run("tp2", "reload_base")
    assert loss_gap(run("tp1", "reload_base"), records) == 0.0
    for record in records:
        gathers = record["gathers"]
        frozen = {name: count for name, count in gathers.items() if ".lora." not in name}
        factors = {name: count for name, count in gathers.items() if ".lora." in name}
        assert frozen and factors, gathers
        assert frozen.pop(f"{LAYER}.weight") == STEPS  # initial gather + one per reload that a forward used
        assert set(frozen.values()) == {1}, frozen
        assert set(factors.values()) == {STEPS}, factors


def test_base_written_through_data_stays_stale():
    """Negative control: the comparison above detects a stale base weight."""
    assert loss_gap(run("tp1", "base_data"), run("tp2", "base_data")) > 1e-4


def test_factor_written_through_data_is_seen_and_the_optimizer_step_advances_the_cache():
    records = run("tp2", "factor_data")
    assert loss_gap(run("tp1", "factor_data"), records) == 0.0
    steps = [step["extra"]["cache_step"] for step in records[0]["steps"]]
    assert all(later > earlier for earlier, later in zip(steps, steps[1:])), steps


def _untracked_factor_write(rank, world_size):
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.tp_invariant import cache

    with Topology.parse("tp2").world(seed=1):
        group = parallel_state.get_tensor_model_parallel_group()
        factor = torch.nn.Parameter(torch.full((2, 3), float(rank + 1)))
        before = cache.cached_gather(factor, 0, 1, group).detach().clone()
        factor.data.mul_(1.5)  # as the mixed-precision optimizer copies its main params back
        stale = cache.cached_gather(factor, 0, 1, group).detach().clone()
        cache.advance_step()
        fresh = cache.cached_gather(factor, 0, 1, group).detach().clone()
        return before, stale, fresh


def test_untracked_factor_write_seen_after_a_step():
    before, stale, fresh = run_world(_untracked_factor_write, 2, timeout=300, name="tp2 cache")[0]
    expected = torch.cat([torch.full((2, 3), 1.5), torch.full((2, 3), 3.0)])  # independent: the written shards
    assert torch.equal(fresh, expected)
    assert torch.equal(stale, before) and not torch.equal(stale, expected)  # negative control: no step, stale


def _recompute_gathers(rank, world_size, clear_in_recompute):
    """Forward + backward of one microbatch plainly, then of the same microbatch under Megatron's
    activation checkpointing (forward without grad, recompute in backward): gathers per tensor
    and the LoRA grads of each pass."""
    from megatron.core import tensor_parallel

    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed import data
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, build_model
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology
    from megatron_lora_patch.tp_invariant import cache

    apply_only(PATCHES, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    cache.all_gather_logical = _counting_gather(cache.all_gather_logical)
    spec = TinyGPTSpec()
    with Topology.parse("tp2").world(seed=1234):
        model = build_model(spec, Topology.parse("tp2"))[0]
        batch = data.make_global_batch(1234, 2, spec.seq_length, spec.vocab_size)

        def loss(anchor, tokens, positions, labels):
            if clear_in_recompute and torch.is_grad_enabled():
                cache.clear()  # negative control: the recompute gathers again
            return model(tokens, positions, None, labels=labels).sum() + anchor

        # Megatron's checkpoint needs one input that requires grad; the token ids cannot.
        anchor = torch.zeros((), requires_grad=True)

        grads = []
        for checkpointed in (False, True):
            model.zero_grad()
            args = (anchor, batch["tokens"], batch["position_ids"], batch["labels"])
            (tensor_parallel.checkpoint(loss, False, *args) if checkpointed else loss(*args)).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        names = {param.data_ptr(): name for name, param in model.named_parameters()}
        return {"gathers": {names[ptr]: count for ptr, count in _GATHERS.items() if ptr in names}, "grads": grads}


@pytest.mark.parametrize("clear_in_recompute", [False, True])
def test_recompute_reuses_the_gathered_weights(clear_in_recompute):
    record = run_world(_recompute_gathers, 2, args=(clear_in_recompute,), timeout=300, name="tp2 recompute")[0]
    plain, recomputed = record["grads"]
    assert plain and plain.keys() == recomputed.keys()
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)  # recompute: same grads, bitwise
    counts = set(record["gathers"].values())
    assert counts == ({2} if clear_in_recompute else {1}), record["gathers"]  # negative control: 2 gathers
