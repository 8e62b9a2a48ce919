"""Fail closed on DoRA (MEGATRON_LORA_DORA, issue 37): what DoRA is not proven for stops with one line,
before any step: a bad value, dropout, MoE experts, shared outer expert factors, Transformer Engine
linears, the layout_invariant mode, what PEFT cannot express, the engine hand-off and merging
(lora/layers/dora_scope.py).
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
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
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


def test_peft_exchange_refuses_what_dora_cannot_express():
    """DoRA travels both ways (tests/test_persistence_peft_dora.py); refused with one line: a DoRA adapter into
    plain LoRA adapters and back, DoRA on peft's target_parameters (experts: peft has no DoRA there), a DoRA
    adapter without its magnitudes, and a DoRA export without the magnitudes."""
    from megatron_lora_patch.lora.exchange import checks, peft

    lora, dora = {"rank": 4, "alpha": 8.0}, {"rank": 4, "alpha": 8.0, "dora": True}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0}
    cases = [
        (lambda: checks.check_config({**config, "use_dora": True}, lora, "adapter_dir"),
         "^adapter_dir: use_dora=true but the model's adapters do not use DoRA; build them with MEGATRON_LORA_DORA=1$"),
        (lambda: checks.check_config(config, dora, "adapter_dir"),
         "^adapter_dir: use_dora=false but the model's adapters use DoRA; build them with MEGATRON_LORA_DORA=0$"),
        (lambda: checks.check_config({**config, "use_dora": True, "target_parameters": ["x"]}, dora, "adapter_dir"),
         r"^adapter_dir: DoRA on target_parameters \(MoE experts\) is not supported"),
        (lambda: peft.from_peft({}, {**config, "use_dora": True}, dora, [], "adapter_dir"),
         r"^adapter_dir: a DoRA adapter \(use_dora=true\) needs from_peft\(\.\.\., magnitudes=\{\}\)$"),
        (lambda: peft.to_peft({"decoder.layers.0.mlp.linear_fc2": (torch.zeros(4, 8), torch.zeros(8, 4))}, dora),
         r"^to_peft: DoRA=True needs a magnitude for each adapted module \(missing \['decoder.layers.0.mlp"),
        (lambda: peft.to_peft({}, lora, magnitudes={"decoder.layers.0.mlp.linear_fc2": torch.ones(8)}),
         r"^to_peft: DoRA=False .*\(extra \['decoder.layers.0.mlp.linear_fc2'\]\)"),
    ]
    for call, pattern in cases:
        with pytest.raises(PeftFormatError, match=pattern):
            call()


def test_handoff_refuses_dora(monkeypatch):
    from megatron_lora_patch.handoff import state
    from megatron_lora_patch.lora import inventory

    monkeypatch.setattr(inventory, "describe", lambda chunks: {"dora": True})
    with pytest.raises(PeftFormatError, match=r"^handoff\.adapter_state: DoRA adapters have no hand-off payload: "
                       r"neither SGLang nor vLLM serves DoRA .*merge_adapters"):
        state.adapter_state([torch.nn.Linear(2, 2)])


def test_engine_payloads_refuse_dora_naming_the_engine():
    """Neither engine serves DoRA (handoff/engines.py): a DoRA state (a PEFT DoRA adapter in memory) is refused
    with one line naming each; the same state as plain LoRA passes (the refusal is DoRA's, nothing else)."""
    from megatron_lora_patch import handoff

    key = "base_model.model.model.layers.0.mlp.down_proj."
    tensors = {key + "lora_A.weight": torch.ones(4, 8), key + "lora_B.weight": torch.ones(8, 4),
               key + "lora_magnitude_vector": torch.ones(8)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["down_proj"], "use_dora": True}
    dora = handoff.AdapterState(config, tensors, "llama")
    for engine, call in (("SGLang", lambda s: handoff.sglang_payload(s, "p")),
                         ("vLLM", lambda s: handoff.vllm_payload(s, "p", 1))):
        with pytest.raises(PeftFormatError, match=rf"^{engine} cannot serve DoRA adapters \(use_dora=true: .*\); "
                           r"roll out merged weights \(merge_adapters\) or train with MEGATRON_LORA_DORA=0$"):
            call(dora)
        assert call(handoff.AdapterState({**config, "use_dora": False}, tensors, "llama"))


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


def _merge_calls(calls: dict, dora: bool = True) -> list:
    import dora_peft_worker

    from megatron_lora_patch.proof.testbed.launcher import run_world

    return run_world(dora_peft_worker.merge_calls_world, 2, args=("tp2", TinyGPTSpec(), 3, dora, calls), name="tp2",
                     timeout=180)


ADAPTERS_PER_LAYER = 4  # linear_qkv, linear_proj, linear_fc1, linear_fc2
MERGE_BOUND_S = 60.0  # far under the process group's timeout (10 to 30 minutes), where a hang would end
COLLECTIVE = "it is collective: every rank must pass the same model chunks to merge_adapters"


def test_a_dora_merge_a_tp_peer_never_calls_is_named_in_one_line_within_the_timeout():
    """DoRA's row-parallel merge all-reduces the row norms over TP: a peer that never calls used to hang the group."""
    ranks = _merge_calls({0: [("model", 3.0)], 1: [None]})
    (refused, seconds), = ranks[0]
    assert refused == ("merge_adapters: rank 1 did not call it within 3 s of rank 0; it is collective: call it on "
                       "every rank of its tensor-parallel group (or pass a larger timeout if a rank is only late)")
    assert 3.0 <= seconds < MERGE_BOUND_S


def test_a_dora_merge_of_other_layers_on_a_tp_peer_is_one_line_on_both_then_they_merge():
    """Control: after the refused call the ranks are in step, and the same chunks on both merge every adapter."""
    ranks = _merge_calls({0: [("model", 60.0), ("model", 60.0)], 1: [("first layer", 60.0), ("model", 60.0)]})
    refused = ranks[0][0][0]
    assert ranks[1][0][0] == refused
    assert refused.startswith("merge_adapters: the ranks disagree on layers (rank 0: '4, decoder.layers.0.")
    assert refused.endswith(COLLECTIVE + " (each rank its shards of the same layers)")
    assert all(seconds < MERGE_BOUND_S for outcomes in ranks for _, seconds in outcomes)
    assert ranks[0][1][0] == ranks[1][1][0] == f"merged {ADAPTERS_PER_LAYER * TinyGPTSpec().num_layers}"


def test_a_plain_lora_merge_needs_no_peer():
    """Plain LoRA merges each shard locally (no collective): a rank merges alone, without waiting."""
    ranks = _merge_calls({0: [("model", 60.0)], 1: [None]}, dora=False)
    outcome, seconds = ranks[0][0]
    assert outcome.startswith("merged ") and seconds < 10.0
