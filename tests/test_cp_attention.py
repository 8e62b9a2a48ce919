"""Context parallelism on the CPU testbed equals world size 1 (proof/testbed/cp_attention.py).

cp2 runs Megatron's load-balanced data split, Megatron's RoPE CP slicing and the
testbed's CP core attention (K/V all-gathered over CP, reduce-scattered in backward),
then Megatron DDP (grads reduced over DP x CP), finalize (token count over DP x CP) and
Adam. Compared with world size 1: the logits of every microbatch (put back in global
sequence order), per-microbatch losses, reported loss, grad norm, finalized grads and
updated params, without LoRA (full-parameter) and with the `lora_correct` patches and
adapters. Negative controls swap the CP attention for broken variants: no K/V gather
(Megatron's local attention with its CP assert removed), gathered K/V left in rank
order, and a K/V gather whose backward does not sum other ranks' key grads.

Each world size is launched once (`runner.run_jobs`): the default part is one world-1
and one cp2 launch. One more cp2 launch (tests/cp_mask_worker.py) checks the core attention alone with a given
`[b, 1, s, s]` mask (documents packed in a row, `--reset-attention-mask`) against its definition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from cp_mask_worker import document_mask, masked_attention_rank, masked_inputs
from error_metrics import assert_steps_within, first_step, relative_l2_error

from megatron_lora_patch.proof.oracle.metrics import compare_results
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.proof.testbed.runner import Job, canonical_result, run_jobs
from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings

#: fp32 tolerance (relative L2 per tensor, worst over tensors and microbatches) on everything
#: computed before the first optimizer update (first-step losses, grad norm and grads): only the
#: order of sums differs. Measured worst: first-step grads 4.4e-7 (the CP sum of partial grads adds
#: in another order than world 1).
TOLERANCE = 5e-6
#: Every quantity of later steps (losses, grad norm, grads) and params after the steps. Adam's first
#: update is about lr * sign(g), so a near-zero grad element that differs by an ulp moves its weight
#: by a whole step, and the next step's grads inherit that; how much depends on the CPU's reduction
#: order, so this bound was set from the noise probe (docs/testing.md "Tolerances"). Measured worst
#: on one machine: grads 8.7e-6 (cp2 LoRA) and 3.0e-5 (tp2-cp2 LoRA, like the oracle's 4.1e-5 on tp2
#: alone), params 5.0e-6, grad norm 1.7e-6 (tp2-cp2 LoRA, step 2; once held to the step-0 bound).
#: The oracle's fp32 later-step reasoning (proof/oracle/thresholds.py).
AFTER_UPDATE_TOLERANCE = 1e-4
#: Forward logits: same scores in the same order on every query row, so 1e-6 is generous.
FORWARD_TOLERANCE = 1e-6
#: A broken CP mechanism must exceed the tolerance by this factor to count as detected.
DETECTION_FACTOR = 100

SPEC = TinyGPTSpec()
LORA_PATCHES = {"cpu_compat": True, "lora_linear": True, "finalize_grads": True, "loss_normalization": True}


def _is_output_layer(name: str, module: torch.nn.Module) -> bool:
    return name == "output_layer"


def _record_cp_layout(seq_length: int, step: int, record: dict, chunks: list) -> None:
    """`on_step_end`: Megatron's CP positions of this rank and the core attention class used."""
    from megatron_lora_patch.proof.testbed.data import cp_sequence_positions

    if step == 0:
        model = chunks[0]
        while hasattr(model, "module"):
            model = model.module
        record["extra"]["cp_positions"] = cp_sequence_positions(seq_length).tolist()
        record["extra"]["core_attention"] = type(model.decoder.layers[0].self_attention.core_attention).__name__


SETTINGS = TrainSettings(
    steps=2,
    global_batch_size=8,
    micro_batch_size=1,
    calculate_per_token_loss=True,
    capture=Capture(forward=_is_output_layer, on_step_end=functools.partial(_record_cp_layout, SPEC.seq_length)),
)


@contextlib.contextmanager
def lora_correct_patches():
    """`Job.context`: the oracle's patches and non-zero-B adapters for one run, then back."""
    import megatron_lora_patch
    from megatron_lora_patch.lora.config import LoraConfig, set_active

    enabled_before = {row.patch: row.enabled for row in megatron_lora_patch.status()}
    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=LORA_PATCHES)
    set_active(LoraConfig(rank=4, alpha=8, b_init="nonzero"))
    try:
        yield
    finally:
        set_active(None)
        newly_enabled = [
            row.patch for row in megatron_lora_patch.status() if row.enabled and not enabled_before.get(row.patch)
        ]
        megatron_lora_patch.revert(newly_enabled)


# ---------------------------------------------------------------- broken CP mechanisms (negative controls)


def _broken_attention_classes() -> dict:
    """Variants of the CP attention, each with one part of the mechanism wrong (built in the rank)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention

    class LocalKeysOnly(ContextParallelDotProductAttention):
        """Megatron's local attention with its cp == 1 assert removed: no K/V exchange."""

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            return DotProductAttention.forward(self, query, key, value, attention_mask, *args, **kwargs)

    class RankOrderKeys(ContextParallelDotProductAttention):
        """K/V gathered but left in rank-block order (chunks 0, 3, 1, 2 for cp2)."""

        def to_global_order(self, gathered, cu_seqlens=None):
            return gathered

    class KeyGradsNotSummed(ContextParallelDotProductAttention):
        """K/V gathered with a backward that only splits: other ranks' key grads are dropped."""

        def all_gather(self, local):
            return gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=False, group=self.cp_group)

    return {cls.__name__: cls for cls in (LocalKeysOnly, RankOrderKeys, KeyGradsNotSummed)}


def swap_core_attention(variant: str, chunks: list) -> None:
    """`on_model_built`: make every layer's CP core attention the named broken variant."""
    from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention

    broken = _broken_attention_classes()[variant]
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is ContextParallelDotProductAttention:
                module.__class__ = broken  # a subclass adding no state: the built instance stays valid


BROKEN_VARIANTS = ("LocalKeysOnly", "RankOrderKeys", "KeyGradsNotSummed")


# ---------------------------------------------------------------- runs


def _broken_job(variant: str) -> Job:
    return Job(
        SPEC, "cp2", dataclasses.replace(SETTINGS, on_model_built=functools.partial(swap_core_attention, variant))
    )


def _run(jobs: dict) -> dict:
    """key -> rank records of every job (one launch per world size)."""
    return dict(zip(jobs, run_jobs(list(jobs.values()))))


def _canonical(records: list, reference_records: list) -> dict:
    """canonical_result with logical shapes read off the world-1 records (covers adapters too)."""
    reference = reference_records[0]
    shapes = {
        reference["shards"][name].logical_name: tuple(tensor.shape)
        for name, tensor in reference["initial_params"].items()
    }
    return canonical_result(records, SPEC, shapes)


def _global_logits(records: list) -> list:
    """Output-layer logits of step 0 per global microbatch, [s, b, vocab], in global sequence order.

    CP ranks hold their chunk positions; TP ranks a vocab shard (parallel_output); microbatch m
    of DP rank r is global microbatch m*dp + r. Unfilled entries stay NaN.
    """
    merged = {}
    for record in records:
        coords, positions = record["coords"], torch.tensor(record["steps"][0]["extra"]["cp_positions"])
        for local_index, output in enumerate(record["steps"][0]["forward"]["output_layer"]):
            logits = (output[0] if isinstance(output, (tuple, list)) else output).float()
            index = local_index * coords["dp_size"] + coords["dp_rank"]
            vocab_shard = logits.shape[-1]
            shape = (SPEC.seq_length, logits.shape[1], vocab_shard * coords["tp_size"])
            full = merged.setdefault(index, torch.full(shape, float("nan")))
            vocab = slice(coords["tp_rank"] * vocab_shard, (coords["tp_rank"] + 1) * vocab_shard)
            full[positions, :, vocab] = logits
    return [merged[index] for index in sorted(merged)]


def _worst_forward_error(records: list, reference_records: list) -> float:
    got, want = _global_logits(records), _global_logits(reference_records)
    assert len(got) == len(want) and all(not torch.isnan(logits).any() for logits in got), "missing logit positions"
    return max(relative_l2_error(actual, expected) for actual, expected in zip(got, want))


def _assert_matches(records: list, reference_records: list) -> None:
    result, reference = _canonical(records, reference_records), _canonical(reference_records, reference_records)
    assert_steps_within(result, reference, TOLERANCE, AFTER_UPDATE_TOLERANCE, where="cp")


@pytest.fixture(scope="module")
def default_runs() -> dict:
    jobs = {
        "world1": Job(SPEC, "tp1", SETTINGS),
        "world1-lora": Job(SPEC, "tp1", SETTINGS, context=lora_correct_patches),
        "cp2": Job(SPEC, "cp2", SETTINGS),
        "cp2-lora": Job(SPEC, "cp2", SETTINGS, context=lora_correct_patches),
    }
    jobs.update({variant: _broken_job(variant) for variant in BROKEN_VARIANTS})
    return _run(jobs)


def test_cp_runs_the_testbed_attention_and_world1_megatrons(default_runs):
    assert {record["steps"][0]["extra"]["core_attention"] for record in default_runs["cp2"]} == {
        "ContextParallelDotProductAttention"
    }
    assert default_runs["world1"][0]["steps"][0]["extra"]["core_attention"] == "DotProductAttention"


def test_chunk_positions_are_megatrons_load_balanced_split(default_runs):
    """The attention's own chunk formula equals get_batch_on_this_cp_rank's split on every rank."""
    from megatron_lora_patch.proof.testbed.cp_attention import cp_chunk_positions

    for record in default_runs["cp2"]:
        coords = record["coords"]
        expected = cp_chunk_positions(SPEC.seq_length, coords["cp_size"], coords["cp_rank"]).tolist()
        assert record["steps"][0]["extra"]["cp_positions"] == expected


@pytest.mark.parametrize("key,reference", [("cp2", "world1"), ("cp2-lora", "world1-lora")])
def test_cp2_forward_logits_equal_world1(default_runs, key, reference):
    error = _worst_forward_error(default_runs[key], default_runs[reference])
    assert error <= FORWARD_TOLERANCE, error


@pytest.mark.parametrize("key,reference", [("cp2", "world1"), ("cp2-lora", "world1-lora")])
def test_cp2_training_steps_match_world1(default_runs, key, reference):
    _assert_matches(default_runs[key], default_runs[reference])


def test_lora_run_trains_adapters_only(default_runs):
    """The LoRA comparison is about adapter grads (A receives grads since B is non-zero)."""
    reference = _canonical(default_runs["world1-lora"], default_runs["world1-lora"])
    grads = reference["steps"][0]["grads"]
    assert grads and all(".lora." in name for name in grads), sorted(grads)
    assert all(float(grad.abs().max()) > 0 for grad in grads.values())


@pytest.mark.parametrize("variant", BROKEN_VARIANTS)
def test_broken_cp_mechanism_is_detected(default_runs, variant):
    """Each broken variant moves the first step's grads far beyond the tolerance."""
    result, reference = (_canonical(default_runs[key], default_runs["world1"]) for key in (variant, "world1"))
    worst = compare_results(first_step(result), first_step(reference))
    assert worst["grads"] > DETECTION_FACTOR * TOLERANCE, worst
    forward = _worst_forward_error(default_runs[variant], default_runs["world1"])
    if variant == "KeyGradsNotSummed":  # forward is exact: only the backward is wrong
        assert forward <= FORWARD_TOLERANCE, forward
    else:
        assert forward > DETECTION_FACTOR * FORWARD_TOLERANCE, forward


# ---------------------------------------------------------------- a given attention mask (document boundaries)


MASK_SEED = 7


def _masked_attention_definition(inputs: dict, mask: torch.Tensor) -> tuple:
    """The definition: masked softmax attention over the whole sequence (GQA: each KV head serves its query
    heads); returns the output [s, b, heads * dim] and the q / k / v grads of sum(output * weight)."""
    query, key, value = (inputs[name].clone().requires_grad_() for name in ("query", "key", "value"))
    repeat = query.size(2) // key.size(2)
    q = query.permute(1, 2, 0, 3)  # [b, heads, s, dim]
    k, v = (tensor.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3) for tensor in (key, value))
    scores = (q @ k.transpose(-1, -2)) / query.size(-1) ** 0.5
    probabilities = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    output = (probabilities @ v).permute(2, 0, 1, 3).flatten(2)
    (output * inputs["weight"]).sum().backward()
    return output.detach(), {"query": query.grad, "key": key.grad, "value": value.grad}


def _assembled(records: list, field: str) -> torch.Tensor:
    """A per-rank tensor of the CP ranks' query rows put back in global sequence order."""
    first = records[0][field]
    full = torch.full((sum(len(record["positions"]) for record in records), *first.shape[1:]), float("nan"))
    for record in records:
        full[record["positions"]] = record[field]
    return full


def test_cp2_attention_applies_a_given_mask_to_the_gathered_keys():
    """The `[b, 1, s/cp, s]` mask `get_batch_on_this_cp_rank` leaves (`--reset-attention-mask`: documents packed in
    a row, per sample) is applied to the CP-gathered keys: output and q / k / v grads equal the definition's. The
    control: the same ranks without the mask (causal only) are far from it."""
    records = run_world(masked_attention_rank, 2, args=(MASK_SEED,), name="cp2", warnings="ignore")
    inputs = masked_inputs(MASK_SEED)
    output, grads = _masked_attention_definition(inputs, document_mask())
    assert relative_l2_error(_assembled(records, "output"), output) <= FORWARD_TOLERANCE
    for name, grad in grads.items():
        per_rank = [{"positions": record["positions"], name: record["grads"][name]} for record in records]
        assert relative_l2_error(_assembled(per_rank, name), grad) <= TOLERANCE, name
    assert relative_l2_error(_assembled(records, "unmasked"), output) > DETECTION_FACTOR * FORWARD_TOLERANCE


# ---------------------------------------------------------------- 4-rank topologies

SLOW_TOPOLOGIES = ("cp2-dp2", "tp2-cp2", "tp2-cp2-sp")


@pytest.fixture(scope="module")
def slow_runs() -> dict:
    jobs = {
        "world1": Job(SPEC, "tp1", SETTINGS),
        "world1-lora": Job(SPEC, "tp1", SETTINGS, context=lora_correct_patches),
    }
    for topology in SLOW_TOPOLOGIES:
        jobs[topology] = Job(SPEC, topology, SETTINGS)
        jobs[topology + "-lora"] = Job(SPEC, topology, SETTINGS, context=lora_correct_patches)
    return _run(jobs)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("topology", SLOW_TOPOLOGIES)
def test_four_rank_cp_training_steps_match_world1(slow_runs, topology, lora):
    suffix = "-lora" if lora else ""
    _assert_matches(slow_runs[topology + suffix], slow_runs["world1" + suffix])
    assert _worst_forward_error(slow_runs[topology + suffix], slow_runs["world1" + suffix]) <= FORWARD_TOLERANCE
