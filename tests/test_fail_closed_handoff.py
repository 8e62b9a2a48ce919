"""The hand-off never hangs on a caller's mistake, and accepts only the families the export accepts.

`handoff.adapter_state` / `stream` are collective. Two real ranks (a TP2 model) make the calls of each case:
ranks passing different `dst`, calling different functions, or one rank not calling at all must end with
one line on every rank within seconds, where they used to block until the process group's timeout
(run_world's own timeout, far below that, would catch a hang). After a refused call the ranks are still
in step: the next proper call hands the adapter over. A family the export refuses for the model is refused
by the hand-off too, in the same words.
"""

from __future__ import annotations

import handoff_worker
import pytest
import torch

from megatron_lora_patch import handoff
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.runtime.errors import UsageError

SEED = 7
SPEC = TinyGPTSpec()
PEFT_TENSORS = 14 * SPEC.num_layers  # per layer: A and B of q, k, v, o, gate, up, down
BOUND_S = 60.0  # well under any collective timeout (10 to 30 minutes): a hang would reach run_world's timeout
COLLECTIVE = "it is collective: every rank must"
GOOD = ("adapter_state", {"dst": 0, "family": "llama"}, 0.0)


def run_calls(calls: dict) -> list:
    return run_world(handoff_worker.calls_world, 2, args=("tp2", SPEC, SEED, calls), name="tp2", timeout=180)


def test_ranks_passing_different_dst_get_one_line_each_then_hand_off():
    calls = {rank: [("adapter_state", {"dst": rank, "family": "llama"}, 0.0), GOOD] for rank in (0, 1)}
    ranks = run_calls(calls)
    message = (f"handoff.adapter_state: the ranks disagree on dst (rank 0: 0, rank 1: 1); {COLLECTIVE} pass the "
               "same dst to handoff.adapter_state")
    assert [outcomes[0][0] for outcomes in ranks] == [message, message]
    assert all(seconds < BOUND_S for outcomes in ranks for _, seconds in outcomes)
    assert [outcomes[1][0] for outcomes in ranks] == [f"ok {PEFT_TENSORS}", "ok 0"]  # still in step


def test_ranks_calling_different_functions_get_one_line_each():
    ranks = run_calls({0: [("stream", {"family": "llama"}, 0.0)], 1: [GOOD]})
    message = ("handoff.{}: the ranks disagree on call (rank 0: 'stream', rank 1: 'adapter_state'); "
               f"{COLLECTIVE} call the same hand-off function (handoff.adapter_state or handoff.stream)")
    assert [outcomes[0][0] for outcomes in ranks] == [message.format("stream"), message.format("adapter_state")]


def test_a_rank_that_never_calls_is_named_after_the_timeout():
    ranks = run_calls({0: [("adapter_state", {"timeout": 3.0}, 0.0)], 1: [None]})
    (outcome, seconds), = ranks[0]
    assert outcome == ("handoff.adapter_state: rank 1 did not call it within 3 s of rank 0; it is collective: "
                       "call it on every rank of the world (or pass a larger timeout if a rank is only late)")
    assert 3.0 <= seconds < BOUND_S
    assert ranks[1] == [("skipped", 0.0)]


def test_a_rank_arriving_after_the_others_gave_up_is_told_at_once():
    ranks = run_calls({0: [("adapter_state", {"timeout": 2.0}, 0.0)], 1: [("adapter_state", {"timeout": 2.0}, 6.0)]})
    assert ranks[0][0][0].startswith("handoff.adapter_state: rank 1 did not call it within 2 s of rank 0")
    late, seconds = ranks[1][0]
    assert late == ("handoff.adapter_state: the other ranks stopped waiting for rank 1 after their timeout; call it "
                    "on every rank of the world at the same point (or pass a larger timeout)")
    assert seconds < 1.0  # not another wait, and no collective the others left


def test_a_family_the_export_refuses_is_refused_by_the_hand_off_too():
    """`qwen3_moe` on a dense model without q / k layernorm: the export's resolver, the export's words."""
    ranks = run_calls({rank: [("adapter_state", {"family": "qwen3_moe"}, 0.0)] for rank in (0, 1)})
    message = ("family qwen3_moe cannot represent the model: no q / k layernorm (qwen3_moe: with), dense layers "
               "(qwen3_moe: MoE); pass family llama or mistral or qwen2")
    assert [outcomes[0][0] for outcomes in ranks] == [message, message]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("inf"), float("nan")])
def test_a_timeout_that_bounds_nothing_is_refused(timeout):
    with pytest.raises(UsageError) as refused:
        handoff.adapter_state([], timeout=timeout)
    assert str(refused.value) == f"handoff.adapter_state: timeout must be a positive number of seconds, got {timeout!r}"


def test_vllm_refuses_an_adapter_on_mla_kv_b_proj_it_would_never_apply():
    key = "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_{}.weight"
    tensors = {key.format("A"): torch.zeros(2, 8), key.format("B"): torch.zeros(6, 2)}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["kv_b_proj"]}
    state = handoff.AdapterState(config, tensors, "deepseek_v3")
    with pytest.raises(UsageError) as refused:
        handoff.vllm_payload(state, "p", 1)
    assert str(refused.value) == (
        "vLLM loads but never applies LoRA on MLA's kv_b_proj (model.layers.0.self_attn.kv_b_proj: absorbed into "
        "W_UK / W_UV, vLLM issue 48974); train with MEGATRON_LORA_EXCLUDE=linear_kv_up_proj, or roll out with SGLang")
    assert handoff.sglang_payload(state, "p")["tensors"].keys() == tensors.keys()  # SGLang applies it (PR 25001)
