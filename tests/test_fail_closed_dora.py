"""Fail closed on DoRA (MEGATRON_LORA_DORA, issue 37): what DoRA is not proven for stops with one line,
before any step: a bad value, dropout, MoE experts, shared outer expert factors, Transformer Engine
linears, the layout_invariant mode, PEFT export, the engine hand-off and merging (lora/layers/dora_scope.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import assert_one_line_error, run_fresh
from test_fail_closed_lora import ACTIVATE, BUILD

from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError, code_labels
from megatron_lora_patch.lora.exchange.names import PeftFormatError
from megatron_lora_patch.lora.layers.dora_scope import refuse_unproven_dora
from megatron_lora_patch.runtime.flags import ACCEPTED_BOOLEANS


def test_bad_value_stops_activation():
    message = f"MEGATRON_LORA_DORA must be one of {ACCEPTED_BOOLEANS}, got 'maybe'"
    assert_one_line_error(run_fresh(["-c", ACTIVATE], MEGATRON_LORA_DORA="maybe"), message)


def test_dora_with_dropout_stops_the_model_build():
    result = run_fresh(["-c", BUILD], MEGATRON_PLUGINS="lora_correct", MEGATRON_LORA_DORA="1",
                       MEGATRON_LORA_DROPOUT="0.1")
    assert_one_line_error(result, "DoRA with dropout (MEGATRON_LORA_DROPOUT=0.1) is not supported (PEFT then rescales "
                          "the dropped-out base term, unproven here); set MEGATRON_LORA_DROPOUT=0 or "
                          "turn DoRA off (MEGATRON_LORA_DORA=0, LoraConfig.dora=False)")


DENSE = SimpleNamespace(is_expert=False)
SCOPE_ERRORS = {
    "sequential expert": (LoraConfig(dora=True), [("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1", 1,
                                                   SimpleNamespace(is_expert=True), False)],
                          "DoRA on MoE experts (decoder.layers.0.mlp.experts.local_experts.1.linear_fc1) is not "
                          "supported; exclude them"),
    "transformer engine": (LoraConfig(dora=True), [("decoder.layers.0.mlp.linear_fc1", None, DENSE, True)],
                           "DoRA on Transformer Engine linears (decoder.layers.0.mlp.linear_fc1) is not supported; "
                           "build the model with the local spec"),
    "shared outer": (LoraConfig(dora=True, expert_shared_outer=True), [],
                     "DoRA with LoraConfig.expert_shared_outer is not supported"),
}


@pytest.mark.parametrize("case", SCOPE_ERRORS)
def test_unproven_scope_is_refused(case):
    config, selected, message = SCOPE_ERRORS[case]
    with pytest.raises(LoraConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        refuse_unproven_dora(config, code_labels(), selected)
    refuse_unproven_dora(LoraConfig(dora=False, expert_shared_outer=config.expert_shared_outer), code_labels(),
                         selected)  # plain LoRA passes the same selection


DORA_EXCHANGE = ("the adapters use DoRA (MEGATRON_LORA_DORA=1), whose exchange with PEFT (use_dora, "
                 "lora_magnitude_vector) is not supported yet; train with MEGATRON_LORA_DORA=0")


def test_peft_export_and_import_refuse_dora():
    """The live-model conversion and an import into DoRA adapters (the export of a DoRA checkpoint:
    tests/test_dora.py)."""
    from megatron_lora_patch.lora.exchange import checks, peft

    description = {"rank": 4, "alpha": 8.0, "dora": True}
    with pytest.raises(PeftFormatError, match="^to_peft: " + DORA_EXCHANGE.replace("(", r"\(").replace(")", r"\)")):
        peft.to_peft({}, description)
    with pytest.raises(PeftFormatError, match="^adapter_dir: the adapters use DoRA"):
        checks.check_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8.0}, description, "adapter_dir")


def test_handoff_refuses_dora(monkeypatch):
    from megatron_lora_patch.handoff import state
    from megatron_lora_patch.lora import inventory

    monkeypatch.setattr(inventory, "describe", lambda chunks: {"dora": True})
    with pytest.raises(PeftFormatError, match=r"^handoff\.adapter_state: DoRA adapters have no hand-off payload"):
        state.adapter_state([torch.nn.Linear(2, 2)])


def test_layout_invariant_refuses_dora():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported, checks
    from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, tag

    module = torch.nn.Linear(2, 2)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, calculate_per_token_loss=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    tag(module.bias, AdapterParamInfo(module="linear_fc2", factor="m", replicated=True, domain="tp", group=None,
                                      expert=False))
    with pytest.raises(LayoutInvariantUnsupported, match="^layout_invariant: DoRA's magnitudes are not proven"):
        checks.check_training(config, module)
