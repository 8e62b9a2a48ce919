"""Megatron-LM's own training loop with DeepSeek-V3's flags (issue 39 item 5): multi-latent attention with a query
latent and the latent norms (`--multi-latent-attention --q-lora-rank ... --qk-layernorm`) and DeepSeek's MoE
(sigmoid router with expert bias, group-limited top-k, routed scaling factor, a shared expert, a leading dense layer
through `--moe-layer-freq`).

`megatron_lm_gpt.py` builds the model from Megatron-LM's arguments (its local spec; `cpu_testbed` gives MLA a CPU
core attention). A base pretrained without LoRA (one iteration) is fine-tuned 4 iterations on one rank with
adapter-sized checkpoints; its checkpoint of iteration 2 resumes on EP2 (experts split over 2 ranks, DP2 for the
rest) for iterations 3-4, which must continue the uninterrupted run within the loop tests' fp32 thresholds: the
first loss (restored weights) at the step-0 bound, the next and the final adapters at the later-step bounds. The
router's expert bias (aux-loss-free balancing, updated from the global token counts each step) is saved with the
adapters and must end identical. `--moe-grouped-gemm` is left out: with `--transformer-impl local` Megatron-Core
0.19's local backend builds the same `SequentialMLP` experts for it (it has no grouped GEMM), so it would add nothing.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest
import torch

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is absent: megatron-core < 0.17 ships no training loop", allow_module_level=True)

from megatron_lm_checkpoints import _deltas, _model_tensors, _relative, _step_losses  # noqa: E402
from megatron_lm_runs import ITERATIONS, LORA_ENV, MODEL_ARGS, TESTBED_ENV, _launch  # noqa: E402

from megatron_lora_patch.proof.oracle.thresholds import threshold  # noqa: E402

RESTORED_LOSS_LIMIT = threshold("fp32", "loss", step=0)
LOSS_LIMIT = threshold("fp32", "loss", step=1)
DELTAS_LIMIT = threshold("fp32", "deltas", step=1)
ENV = {key: value for key, value in LORA_ENV.items() if key != "MEGATRON_LORA_FULL_CHECKPOINTS"}  # adapter-sized
_GQA = MODEL_ARGS.index("--group-query-attention")  # then "--num-query-groups N": MLA excludes GQA in Megatron-LM
assert MODEL_ARGS[_GQA + 1] == "--num-query-groups"
MLA_ARGS = [
    *MODEL_ARGS[:_GQA],
    *MODEL_ARGS[_GQA + 3 :],
    *("--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-layernorm"),
    *("--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"),
]
MOE_ARGS = [
    *("--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "allgather"),
    *("--moe-router-topk", "2", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"),
    *("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"),
    *("--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "32"),
    *("--moe-layer-freq", "[0,1]"),  # DeepSeek's first_k_dense_replace: layer 0 dense, layer 1 MoE
]
DEEPSEEK_ARGS = tuple(MLA_ARGS + MOE_ARGS)
EXPERT_BIAS = "decoder.layers.1.mlp.router.expert_bias"
ADAPTED = {
    "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
    "linear_fc1", "linear_fc2",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base (1 iteration, no LoRA), the uninterrupted LoRA run, and its iteration 2 resumed on EP2."""
    root = tmp_path_factory.mktemp("deepseek")
    base, run, resumed = root / "base", root / "run", root / "ep2"
    one_iteration = ("--train-iters", "1")
    _launch(sys.executable, 1, ["--save", str(base), "--save-interval", "1"], TESTBED_ENV, root / "rec-base",
            overrides=one_iteration, model=DEEPSEEK_ARGS)
    lora = ["--pretrained-checkpoint", str(base), "--load", str(run), "--save", str(run), "--save-interval", "2"]
    _launch(sys.executable, 1, lora, ENV, root / "rec-run", model=DEEPSEEK_ARGS)
    shutil.copytree(run / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    ep2 = ["--load", str(resumed), "--save", str(resumed), "--save-interval", "2", "--expert-model-parallel-size", "2"]
    _launch(sys.executable, 2, ep2, ENV, root / "rec-ep2", model=DEEPSEEK_ARGS)
    return root


def test_adapters_train_on_every_mla_linear_the_experts_and_the_shared_expert(runs):
    adapters = {key: value for key, value in _model_tensors(runs / "run").items() if ".lora." in key}
    assert {key.rsplit(".lora.", 1)[0].rsplit(".", 1)[-1] for key in adapters} == ADAPTED
    assert any(".mlp.experts." in key for key in adapters) and any(".shared_experts." in key for key in adapters)
    assert any(key.startswith("decoder.layers.0.mlp.linear_fc1.") for key in adapters)  # the leading dense layer
    assert all(value.abs().max() > 0 for value in _deltas(adapters).values()), "an adapter did not train"


def test_checkpoints_hold_the_adapters_the_expert_bias_and_their_adam_state_only(runs):
    """Adapter-sized: no frozen base tensor is saved, only the adapters, their two Adam moments and the router's
    expert bias (a buffer training updates: DeepSeek's aux-loss-free balancing)."""
    from megatron.core import dist_checkpointing

    from megatron_lora_patch.lora.checkpoints import source

    for directory in (runs / "run" / "iter_0000002", runs / "ep2" / "iter_0000004"):
        with source.process_group():
            held = dist_checkpointing.load_tensors_metadata(str(directory))
        model = {key: entry for key, entry in held.items() if not key.startswith("optimizer.")}
        adapters = {key for key in model if ".lora." in key}
        assert adapters and set(model) - adapters == {EXPERT_BIAS}, sorted(model)
        numel = {key: _numel(entry) for key, entry in held.items()}
        adapter_numel = sum(numel[key] for key in adapters)
        assert sum(numel.values()) == 3 * adapter_numel + numel[EXPERT_BIAS]


def _numel(entry) -> int:
    count = 1
    for size in entry.global_shape:
        count *= size
    return count


def test_resume_on_ep2_continues_the_uninterrupted_run(runs):
    reference = _step_losses(runs / "rec-run", 1)
    losses = _step_losses(runs / "rec-ep2", 2)
    assert len(reference) == ITERATIONS and len(losses) == 2
    misses = [abs(a - b) / abs(b) for a, b in zip(losses, reference[2:])]
    print(f"resumed on EP2, relative loss miss per iteration: {misses}")
    assert misses[0] <= RESTORED_LOSS_LIMIT and misses[1] <= LOSS_LIMIT, misses
    expected, actual = _model_tensors(runs / "run"), _model_tensors(runs / "ep2")
    expected_deltas, actual_deltas = _deltas(expected), _deltas(actual)
    assert expected_deltas.keys() == actual_deltas.keys()
    assert max(_relative(actual_deltas[key], expected_deltas[key]) for key in expected_deltas) <= DELTAS_LIMIT
    # the bias the resume started from (iteration 2's) must have moved by iteration 4, or the check is vacuous
    early = _model_tensors(runs / "run" / "iter_0000002")[EXPERT_BIAS]
    assert not torch.equal(early, expected[EXPERT_BIAS]), "the expert bias did not move in iterations 3-4"
    assert torch.equal(actual[EXPERT_BIAS], expected[EXPERT_BIAS])


def test_two_steps_of_training_are_far_outside_the_tolerance(runs):
    """Negative control: the adapters after 2 and 4 steps differ by >= 100x the delta threshold."""
    early = _deltas(_model_tensors(runs / "run" / "iter_0000002"))
    final = _deltas(_model_tensors(runs / "run"))
    assert max(_relative(early[key], final[key]) for key in final) >= 100 * DELTAS_LIMIT
