"""Megatron-Core 0.17-0.19 API changes on the plugin's own code paths (issue 14, breakages 1-9).

One world-size-1 run (tests/megatron_compat_worker.py) per module, with every default patch
plus layout_invariant (formerly tp_invariant) applied strictly, so a patch that fails on the installed Megatron fails
here:
- full activation recompute gives the first layer's adapters a gradient (0.18 moved the
  checkpointed forward to `megatron.core.recompute.checkpointed_forward`);
- the testbed's CP split (`get_batch_on_this_cp_rank`, 0.18 added `is_hybrid_cp`);
- the gloo all-to-all accepts `use_nccl_stream` (0.18);
- the TP-invariant loss accepts `tp_group` (0.19);
- GTP (0.19) with LoRA stops with one line;
- `HybridModel` (0.18+; `MambaModel` before) gets adapters on its attention and MLP linears, frozen base;
  targeting Mamba/GDN mixer linears stops with one line (a `UsageError`).
"""

from __future__ import annotations

import megatron_compat_worker as worker
import pytest
import torch

from megatron_lora_patch.lora.config import DEFAULT_TARGETS
from megatron_lora_patch.lora.layers.unsupported import UnsupportedModelError, refuse_unsupported
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.runtime.errors import UsageError

GTP_MESSAGE = (
    "LoRA is not supported with generalized tensor parallelism (gtp_weight_remat_size 2, "
    "expert_gtp_weight_remat_size 1); set --tensor-parallel-num-weight-shards and "
    "--expert-tensor-parallel-num-weight-shards to the TP / expert-TP sizes (GTP off)"
)


@pytest.fixture(scope="module")
def found():
    return run_world(worker.world1, 1, name="compat-world1", timeout=300)[0]


def test_every_patch_applies(found):
    assert {name: state for name, state in found["status"].items() if name != "null_tokenizer"} == {
        "cpu_compat": "applied",
        "lora_linear": "applied",
        "lora_checkpoint": "applied",
        "finalize_grads": "applied",
        "loss_normalization": "applied",
        "lora_plus": "applied",
        "layout_invariant": "applied",
    }


def test_full_recompute_reaches_first_layer_adapters(found):
    grads = found["gpt_recompute"]
    assert len(grads) == 4 and all(value > 1e-3 for value in grads.values()), grads


def test_cp_split_at_cp1_keeps_the_sequence(found):
    assert found["cp_positions"] == list(range(8))


def test_gloo_all_to_all_with_list_splits(found):
    assert found["all_to_all"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_tp_invariant_loss_is_cross_entropy(found):
    assert found["loss_error"] < 1e-5


def test_gtp_is_refused(found):
    if "gtp" not in found:
        pytest.skip("not applicable to this Megatron-Core: no generalized tensor parallelism (0.19+)")
    assert found["gtp"] == GTP_MESSAGE


def test_hybrid_model_gets_attention_and_mlp_adapters(found):
    """HybridModel from 0.18; before it MambaModel, a class of its own, hooked separately."""
    hybrid = found.get("hybrid") or found["mamba"]
    expected = sorted(
        f"decoder.layers.{layer}.{block}.{linear}.lora.{factor}"
        for layer, block in enumerate(["self_attention", "mlp"] * 2)
        for linear in DEFAULT_TARGETS[:4]  # the GQA and MLP ones (the others are MLA's)
        if (block == "mlp") == linear.startswith("linear_fc")
        for factor in "AB"
    )
    assert hybrid["trainable"] == expected
    assert len(hybrid["layer0_b_grads"]) == 2 and all(v > 1e-3 for v in hybrid["layer0_b_grads"].values())


class MambaMixer(torch.nn.Module):
    """Stands in for Megatron's mixer, which needs the mamba_ssm CUDA kernels to construct;
    `refuse_unsupported` looks only at the parent's module (megatron.core.ssm)."""

    __module__ = "megatron.core.ssm.mamba_mixer"


def test_mamba_mixer_targets_are_refused_attention_and_mlp_are_not():
    linear, model = torch.nn.Linear(2, 2), torch.nn.Module()
    mixer_linears = [(f"decoder.layers.0.mixer.{name}", linear, MambaMixer()) for name in ("in_proj", "out_proj")]
    assert issubclass(UnsupportedModelError, UsageError)
    with pytest.raises(UnsupportedModelError) as refused:
        refuse_unsupported(model, mixer_linears)
    assert str(refused.value) == (
        "LoRA on Mamba/GDN mixer linears is not supported: decoder.layers.0.mixer.in_proj, "
        "decoder.layers.0.mixer.out_proj; drop them from MEGATRON_LORA_TARGETS or add them to "
        "MEGATRON_LORA_EXCLUDE (attention and MLP linears are supported)"
    )
    from megatron.core.transformer.mlp import MLP

    refuse_unsupported(model, [("decoder.layers.1.mlp.linear_fc1", linear, MLP.__new__(MLP))])


class TELinear(torch.nn.Linear):
    """Stands in for Megatron's `TELinear` (Transformer Engine needs CUDA): `te_linear_kind` reads the class
    from `megatron.core.extensions.transformer_engine` and the instance's `parallel_mode`."""

    parallel_mode = "duplicated"


def _mla_attention_with_te_down_projection() -> torch.nn.Module:
    """decoder.layers.0.self_attention.linear_kv_down_proj as the TE spec builds it."""
    attention, layer, decoder, model = (torch.nn.Module() for _ in range(4))
    attention.linear_kv_down_proj = TELinear(4, 4)
    layer.self_attention = attention
    decoder.layers = torch.nn.ModuleList([layer])
    model.decoder = decoder
    return model


def test_te_spec_duplicated_mla_down_projection_is_refused_unless_excluded(monkeypatch):
    """The TE spec builds MLA's down projections as duplicated `TELinear`s (no adapter grad domain fits them):
    targeted (the defaults name them) is one line; excluded as the line says, attach goes on (and here finds
    nothing else to adapt)."""
    import importlib

    from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError
    from megatron_lora_patch.lora.layers.attach import attach_adapters
    from megatron_lora_patch.lora.layers.te import TE_MODULE

    monkeypatch.setattr(importlib.import_module(TE_MODULE), "TELinear", TELinear)
    model = _mla_attention_with_te_down_projection()
    with pytest.raises(UnsupportedModelError) as refused:
        attach_adapters(model, LoraConfig())
    assert str(refused.value) == (
        "LoRA on Transformer Engine duplicated linears (MLA's down projections in the TE spec) is not supported: "
        "decoder.layers.0.self_attention.linear_kv_down_proj; add linear_q_down_proj,linear_kv_down_proj to "
        "MEGATRON_LORA_EXCLUDE or build the model with the local spec (column-parallel down projections)"
    )
    with pytest.raises(LoraConfigError, match="excludes all 1 linear layers"):
        attach_adapters(model, LoraConfig(exclude=("linear_kv_down_proj",)))


def test_oracle_hybrid_model_runs_where_megatron_has_hybrid_model():
    """`oracle --model hybrid` picks the HybridModel spec on 0.18+, and is one OracleError before that."""
    import importlib.util

    from megatron_lora_patch.proof.oracle import harness
    from megatron_lora_patch.proof.testbed.topology import Topology

    settings = harness.OracleSettings(model="hybrid")
    if importlib.util.find_spec("megatron.core.models.hybrid") is not None:
        assert harness.check_topology(Topology.parse("tp2-sp"), settings).hybrid_pattern == "*-*-"
    else:
        with pytest.raises(harness.OracleError, match="--model hybrid needs Megatron-Core 0.18 or newer"):
            harness.check_topology(Topology.parse("tp2-sp"), settings)
    with pytest.raises(harness.OracleError, match="shards experts but --model hybrid has none"):
        harness.check_topology(Topology.parse("ep2"), settings)
