"""`tp_invariant`: LoRA training on the dense GQA testbed is BITWISE identical across TP degrees.

Each topology runs K=3 real Megatron training steps (DDP, schedule, finalize, optimizer with
clipping) of the tiny GPT with LoRA on every linear (non-zero B, so every factor gets a
grad). TP=2 (with and without SP) is compared with TP=1 by `torch.equal` on: per-token
losses and the decoder output of every microbatch (forward), the grad of the residual
stream entering layer 1 (input grads), the adapter grads after finalize, the grad norm,
and the adapter weights after every step. With the patch off, the same comparison finds
differences (the test can fail). TP=4 (heads/groups 8/4) is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.patches.layout_invariant import SPEC
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.runtime import versions

_OUT_OF_RANGE = versions.out_of_range_reason(SPEC.name, SPEC.versions, versions.installed_megatron_core())
pytestmark = pytest.mark.skipif(bool(_OUT_OF_RANGE), reason=f"tp_invariant does not apply here: {_OUT_OF_RANGE}")

STEPS = 3
BASE_PATCHES = ("cpu_compat", "lora_linear", "finalize_grads", "loss_normalization")
#: What the layer-1 input hooks saw, per backward (reset after each step).
_INPUT_GRADS: list = []


# -- in the ranks --------------------------------------------------------------------------


def _capture_input_grad(module, args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is not None and hidden.requires_grad:
        hidden.register_hook(lambda grad: _INPUT_GRADS.append(grad.detach().clone()))


def _hook_layer_one(chunks) -> None:
    chunks[0].decoder.layers[1].register_forward_pre_hook(_capture_input_grad, with_kwargs=True)


def _take_input_grads(step, record, chunks) -> None:
    record["extra"]["input_grads"] = list(_INPUT_GRADS)
    _INPUT_GRADS.clear()


def _forward_modules(name, module) -> bool:
    return name in ("", "decoder")  # per-token losses and the final hidden states


def _train(rank, world_size, spec, topology_text, invariant):
    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed.driver import train_steps
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings
    from megatron_lora_patch.proof.testbed.topology import Topology

    wanted = set(BASE_PATCHES) | ({"tp_invariant"} if invariant else set())
    apply_only(wanted, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    settings = TrainSettings(
        steps=STEPS,
        global_batch_size=4,
        on_model_built=_hook_layer_one,
        capture=Capture(params_every_step=True, forward=_forward_modules, on_step_end=_take_input_grads),
    )
    topology = Topology.parse(topology_text)
    with topology.world(seed=settings.seed):
        return train_steps(spec, topology, settings)


def run(spec, topology_text: str, invariant: bool) -> list:
    from megatron_lora_patch.proof.testbed.topology import Topology

    world_size = Topology.parse(topology_text).world_size
    return run_world(_train, world_size, args=(spec, topology_text, invariant), timeout=600, name=topology_text)


# -- comparison against TP=1 --------------------------------------------------------------


def _expected_local(name: str, full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of the TP=1 tensor: the dim whose size differs, stride 2 for SwiGLU fc1 rows."""
    from megatron_lora_patch.lora.adapters.layouts import shard

    if full.shape == local.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    stride = 2 if "linear_fc1" in name and dim == 0 else 1
    return shard(full, dim, rank, world, stride)


def _structure_mismatches(ref: dict, record: dict, where: str) -> list:
    """Steps, tensor names and forward captures that one side has and the other lacks (zip would hide them)."""
    found = []
    if len(ref["steps"]) != len(record["steps"]):
        found.append(f"{where}: {len(record['steps'])} steps, not {len(ref['steps'])}")
    for step, (want, got) in enumerate(zip(ref["steps"], record["steps"])):
        for part in ("grads", "params", "forward"):
            if set(want[part]) != set(got[part]):
                found.append(f"{where} step {step}: {part} names differ: {sorted(set(want[part]) ^ set(got[part]))}")
        for module in set(want["forward"]) & set(got["forward"]):
            if len(want["forward"][module]) != len(got["forward"][module]):
                found.append(f"{where} step {step}: forward {module or 'loss'} microbatch count")
    return found


def mismatches(reference: list, records: list) -> list:
    """Every quantity of `records` (any TP) that is not bitwise equal to the TP=1 `reference`."""
    ref = reference[0]
    found = []
    for record in records:
        coords = record["coords"]
        rank, world = coords["tp_rank"], coords["tp_size"]
        where = f"tp_rank {rank}"
        found += _structure_mismatches(ref, record, where)
        for step, (want, got) in enumerate(zip(ref["steps"], record["steps"])):
            if want["grad_norm"] != got["grad_norm"]:
                found.append(f"{where} step {step}: grad_norm {got['grad_norm']!r} != {want['grad_norm']!r}")
            if want["microbatches"] != got["microbatches"]:
                found.append(f"{where} step {step}: losses {got['microbatches']} != {want['microbatches']}")
            for phase in ("grads", "params"):
                for name, full in want[phase].items():
                    local = got[phase].get(name)
                    if local is None:
                        continue  # reported by _structure_mismatches
                    if not torch.equal(local, _expected_local(name, full, local, rank, world)):
                        found.append(f"{where} step {step}: {phase} {name}")
            for module, outputs in want["forward"].items():
                for index, (full, local) in enumerate(zip(outputs, got["forward"].get(module, ()))):
                    full = full[0] if isinstance(full, tuple) else full
                    local = local[0] if isinstance(local, tuple) else local
                    if not torch.equal(local, _expected_local(module, full, local, rank, world)):
                        found.append(f"{where} step {step}: forward {module or 'loss'} microbatch {index}")
            pairs = zip(want["extra"]["input_grads"], got["extra"]["input_grads"])
            for index, (full, local) in enumerate(pairs):
                if not torch.equal(local, _expected_local("input", full, local, rank, world)):
                    found.append(f"{where} step {step}: input grad {index}")
            if len(want["extra"]["input_grads"]) != len(got["extra"]["input_grads"]):
                found.append(f"{where} step {step}: input grad count")
    return found


def _checked_counts(records: list) -> None:
    """The comparison covers something in every category (an empty capture must not pass)."""
    step = records[0]["steps"][-1]
    assert step["grads"] and step["params"] and step["grad_norm"] is not None
    assert {"", "decoder"} <= set(step["forward"]) and step["extra"]["input_grads"]
    assert any(".lora.A" in name for name in step["grads"]) and any(".lora.B" in name for name in step["grads"])


@pytest.fixture(scope="module")
def fp32_spec():
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    return TinyGPTSpec()


@pytest.fixture(scope="module")
def fp32_reference(fp32_spec):
    records = run(fp32_spec, "tp1", invariant=True)
    _checked_counts(records)
    return records


@pytest.mark.parametrize("topology", ["tp2", "tp2-sp"])
def test_fp32_bitwise_equal_to_tp1(fp32_spec, fp32_reference, topology):
    records = run(fp32_spec, topology, invariant=True)
    assert len(records) == 2
    assert mismatches(fp32_reference, records) == []


def test_without_the_patch_tp2_differs(fp32_spec):
    """Same comparison with the mode off: TP=2 is NOT bitwise TP=1 (ULP-level partial-sum differences)."""
    reference = run(fp32_spec, "tp1", invariant=False)
    found = mismatches(reference, run(fp32_spec, "tp2-sp", invariant=False))
    assert found, "the mode-off run matched bit for bit: the comparison could not detect a difference"
    assert any("grads" in entry for entry in found)


def _bf16_forward_backward(rank, world_size, spec, topology_text):
    """bf16 model (no optimizer: Megatron's Float16 optimizer refuses CPU tensors): losses, adapter grads."""
    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed import data
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    wanted = set(BASE_PATCHES) | {"tp_invariant"}
    apply_only(wanted, strict=True)
    set_active(LoraConfig(rank=4, alpha=8.0, b_init="nonzero"))
    topology = Topology.parse(topology_text)
    with topology.world(seed=1234):
        model = build_model(spec, topology)[0]
        batch = data.make_global_batch(1234, 2, spec.seq_length, spec.vocab_size)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        (losses.float() * batch["loss_mask"]).sum().backward()
        grads = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
        return {"losses": losses.detach().clone(), "grads": grads}


def test_bf16_forward_and_adapter_grads_bitwise_equal_to_tp1():
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    spec = TinyGPTSpec(dtype="bfloat16")
    reference = run_world(_bf16_forward_backward, 1, args=(spec, "tp1"), timeout=600, name="tp1")[0]
    records = run_world(_bf16_forward_backward, 2, args=(spec, "tp2-sp"), timeout=600, name="tp2-sp")
    assert reference["grads"] and all(grad.dtype == torch.bfloat16 for grad in reference["grads"].values())
    for rank, record in enumerate(records):
        assert torch.equal(record["losses"], reference["losses"])
        for name, full in reference["grads"].items():
            local = record["grads"][name]
            assert torch.equal(local, _expected_local(name, full, local, rank, 2)), f"tp_rank {rank}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["tp2", "tp4", "tp4-sp"])
def test_tp4_bitwise_equal_to_tp1(topology):
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    spec = TinyGPTSpec(num_attention_heads=8, num_query_groups=4)
    assert mismatches(run(spec, "tp1", invariant=True), run(spec, topology, invariant=True)) == []


def test_apply_and_revert_restore_megatron_exactly():
    """Every target of `layout_invariant` (formerly `tp_invariant`) is wrapped while on (status 'applied')
    and is the original object again after revert;
    the grad-sync strategy (dense and expert replicated factors complete, no (expert) TP SUM) is declared while on
    and undone by revert."""
    import megatron.core.distributed.distributed_data_parallel as ddp
    import megatron.core.models.common.language_module.language_module as language_module
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.cross_entropy as cross_entropy
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.mlp as mlp

    import megatron_lora_patch
    import megatron_lora_patch.lora.training.grad_sync as grad_sync
    from megatron_lora_patch.plugins.lora_correct import PATCH_NAMES

    targets = [
        (vars(layers.ColumnParallelLinear), "_forward_impl"), (vars(layers.RowParallelLinear), "_forward_impl"),
        (vars(mlp.MLP), "__init__"), (vars(cross_entropy), "vocab_parallel_cross_entropy"),
        (vars(tensor_parallel), "vocab_parallel_cross_entropy"),
        (vars(language_module), "fused_vocab_parallel_cross_entropy"),
        (vars(optimizer.MegatronOptimizer), "get_grad_norm"), (vars(optimizer.MegatronOptimizer), "clip_grad_norm"),
        (vars(optimizer.ChainedOptimizer), "get_grad_norm"),
        (vars(ddp.DistributedDataParallel), "_make_backward_post_hook"),
        (vars(ddp.DistributedDataParallel), "zero_grad_buffer"),
        (vars(ddp.DistributedDataParallel), "finish_grad_sync"), (vars(schedules), "backward_step"),
    ]
    originals = [namespace[name] for namespace, name in targets]
    try:
        megatron_lora_patch.apply(
            plugins=["lora_correct"], enable={name: name == "layout_invariant" for name in PATCH_NAMES}, strict=True
        )
        row = next(row for row in megatron_lora_patch.status() if row.patch == "layout_invariant")
        assert row.state == "applied"
        assert all(namespace[name] is not original for (namespace, name), original in zip(targets, originals))
        assert grad_sync.set_complete_domains(frozenset({"tp", "expert_tp"})) == {"tp", "expert_tp"}
    finally:
        megatron_lora_patch.revert()
    assert all(namespace[name] is original for (namespace, name), original in zip(targets, originals))
    assert grad_sync.set_complete_domains(frozenset()) == frozenset()
