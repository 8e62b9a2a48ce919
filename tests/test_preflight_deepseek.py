"""The preflight on DeepSeek-V3's own flags (issue 39, item 5): 61 layers, hidden 7168, multi-latent attention
(q / kv latent ranks 1536 / 512, head dims 128 + 64 rope / 128), 128 heads, 256 experts top-8 in 8 groups
(group top-4), a sigmoid router with the expert bias, routed scaling 2.5, a shared expert, 3 dense layers first,
vocabulary 129280, at EP2. The world-1 reference of even two layers needs ~104 GiB, so the preflight cuts, in
order and only as far as the budget needs: depth, routed experts, vocabulary, then every width by one common
factor; it says what it cut in one line. The cut model must match world-1, and the expert bias moved by each
rank's own token counts must fail. The rules of the cut are checked on the plan alone (no ranks).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

if importlib.util.find_spec("megatron.training") is None:  # absent only: an import error in it must fail
    pytest.skip(
        "preflight parses with Megatron-LM's argument parser: megatron.training is absent (megatron-core < 0.17)",
        allow_module_level=True,
    )

from preflight_cases import DENSE, TP2_SP, assert_passed, options, user_environ  # noqa: E402, F401 (fixture)

from megatron_lora_patch.proof.oracle import preflight, preflight_run  # noqa: E402
from megatron_lora_patch.proof.testbed.args_cuts import estimate_parameters  # noqa: E402
from megatron_lora_patch.runtime.errors import UsageError  # noqa: E402

EP2 = ["--expert-model-parallel-size", "2"]
DEEPSEEK_V3 = [
    *DENSE[DENSE.index("--swiglu") : DENSE.index("--seq-length")],  # swiglu, RMSNorm, rope, no biases, untied
    *"--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432".split(),
    *"--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-layernorm".split(),  # latent norms
    *"--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128".split(),
    *"--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-token-dispatcher-type allgather".split(),
    *"--moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-score-function sigmoid".split(),
    *"--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5".split(),
    *"--moe-shared-expert-intermediate-size 2048 --moe-layer-freq ([0]*3+[1]*58)".split(),
    *"--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 64".split(),
    *"--lr 1e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 129280".split(),
    *EP2,
]
TINY = dict(seq_length=16, max_parameters=0.5)  # 0.5M parameters: the cut model trains in seconds
CUT_LINE = (
    "  cut to fit memory / --max-parameters: --num-experts 256 -> 16, --vocab-size 129280 -> 256, "
    "--hidden-size 7168 -> 134, --ffn-hidden-size 18432 -> 346, --moe-ffn-hidden-size 2048 -> 38, "
    "--moe-shared-expert-intermediate-size 2048 -> 38, --q-lora-rank 1536 -> 28, --kv-lora-rank 512 -> 16, "
    "--qk-head-dim 128 -> 16, --qk-pos-emb-head-dim 64 -> 16, --v-head-dim 128 -> 16, --num-attention-heads 128 -> 2"
)


def test_deepseek_v3_flags_run_cut_to_fit_and_a_local_expert_bias_fails(user_environ):
    plan = preflight.make_plan(options(DEEPSEEK_V3, **TINY))
    summary = plan.summary().splitlines()
    assert CUT_LINE in summary, plan.summary()
    assert "  layers: 2 of your 61 (every layer kind once: 0: dense, 1: moe); cut to fit, below" in summary
    assert plan.parameters <= 0.5e6
    assert_passed(preflight_run.run_plan(plan), "ep2", ["dense", "moe"])
    mutated = preflight_run.run_plan(preflight.make_plan(options(DEEPSEEK_V3, mutation="expert_bias_from_local_counts",
                                                                 **TINY)))
    assert not mutated.passed and mutated.drift["layer_kind"] == "moe", mutated.drift


def test_the_kv_adapter_after_the_latent_norm_fails_the_cut_model(user_environ):
    """PEFT's kv_a_proj_with_mqa adapter sits before kv_a_layernorm; added after it, the cut model must fail at EP2
    (measured: forward 1.8e5x its threshold)."""
    mutated = preflight_run.run_plan(preflight.make_plan(options(DEEPSEEK_V3, mutation=KV_AFTER_NORM, **TINY)))
    assert not mutated.passed and mutated.topologies[0].error is None, mutated.table()
    forward = mutated.topologies[0].phases["forward"]
    assert forward.rel_l2 > 100 * forward.threshold, mutated.table()


def test_a_partial_rope_key_grad_fails_the_cut_model_at_tp2_sp(user_environ):
    """Megatron's local-spec MLA leaves the RoPE key's grad a partial sum over TP (lora_linear sums it): undone, the
    cut model at TP2 + SP must fail (measured: loss 101x, grads 2.1e3x its threshold; forward unchanged)."""
    at_tp2 = [*DEEPSEEK_V3[: -len(EP2)], *TP2_SP]
    mutated = preflight_run.run_plan(preflight.make_plan(options(at_tp2, mutation="mla_rope_key_grad_partial", **TINY)))
    assert not mutated.passed and mutated.topologies[0].error is None, mutated.table()
    grads = mutated.topologies[0].phases["grads"]
    assert grads.rel_l2 > 100 * grads.threshold, mutated.table()


KV_AFTER_NORM = "kv_adapter_after_latent_layernorm"
WITHOUT_LATENT_NORMS = [argument for argument in DEEPSEEK_V3 if argument != "--qk-layernorm"]
UNCHANGED_RUNS = {  # a mutation the arguments leave nothing to change in is refused, never a vacuous pass
    KV_AFTER_NORM: (
        WITHOUT_LATENT_NORMS,
        f"mutation {KV_AFTER_NORM} needs MLA's latent norms (--qk-layernorm); your arguments have no --qk-layernorm",
    ),
    "mla_rope_key_grad_partial": (
        DEEPSEEK_V3,
        "mutation mla_rope_key_grad_partial changes nothing without tensor parallelism (your topology: ep2); use "
        "--tensor-model-parallel-size 2 or more",
    ),
    "mla_down_projection_grad_not_summed": (
        DENSE,
        "mutation mla_down_projection_grad_not_summed needs multi-latent attention (--multi-latent-attention); your "
        "arguments have no --multi-latent-attention",
    ),
}


@pytest.mark.parametrize("mutation", UNCHANGED_RUNS)
def test_an_mla_mutation_the_model_cannot_show_is_refused(user_environ, mutation):
    arguments, message = UNCHANGED_RUNS[mutation]
    with pytest.raises(UsageError, match="^" + re.escape(message) + "$"):
        preflight.make_plan(options(arguments, mutation=mutation, **TINY))


def test_the_cut_keeps_the_structure_and_stops_as_soon_as_it_fits(user_environ):
    """A budget the expert cut alone meets cuts only experts, to the most that fit; the routing stays valid."""
    # no --max-parameters (the default): the widths stay where memory allows
    uncut = preflight.make_plan(options(DEEPSEEK_V3, max_parameters=None, max_memory_gib=1e4))
    assert uncut.spec.cuts == () and uncut.parameters > 5e9  # two layers at DeepSeek's widths: nothing cut
    budget = uncut.parameters - 100 * _expert_parameters(uncut.spec.args)  # room for 156 experts, not 160
    plan = preflight.make_plan(options(DEEPSEEK_V3, max_parameters=budget / 1e6, max_memory_gib=1e4))
    assert plan.spec.cuts == (("--num-experts", 256, 152),)  # a multiple of 8 groups (and EP2), top-8 kept
    assert estimate_parameters(plan.spec) <= budget
    args = plan.spec.args
    assert (args.moe_router_topk, args.moe_router_num_groups, args.moe_router_group_topk) == (8, 8, 4)
    assert args.multi_latent_attention and args.moe_router_enable_expert_bias and args.hidden_size == 7168


def test_the_cut_model_holds_every_rule_at_the_floor(user_environ):
    """At the floor: experts still fill top-8 from the 4 chosen of 8 groups over EP2, widths at the LoRA rank."""
    plan = preflight.make_plan(options(DEEPSEEK_V3, max_parameters=1e-6, max_memory_gib=1e4))
    cut = dict((option, run) for option, _, run in plan.spec.cuts)
    assert cut["--num-experts"] == 16 and cut["--vocab-size"] == 256
    assert cut["--num-attention-heads"] == 1 and cut["--kv-lora-rank"] == 16 and cut["--hidden-size"] == 16


def _expert_parameters(args) -> int:
    """One routed expert of DeepSeek-V3's MoE layer: swiglu fc1 (2x), fc2, and its router row."""
    return 3 * args.hidden_size * args.moe_ffn_hidden_size + args.hidden_size


def test_a_gqa_model_at_tp2_is_cut_to_heads_and_groups_that_tp_divides(user_environ):
    """GQA at TP2: heads stay a multiple of 2 and of the query groups, widths multiples of 2 at the LoRA rank's
    floor (16); a vocabulary under the floor stays; Megatron's config accepts the cut model (make_plan checks)."""
    plan = preflight.make_plan(options([*DENSE, *TP2_SP], max_parameters=1e-6))
    assert plan.spec.cuts == (
        ("--hidden-size", 64, 16), ("--ffn-hidden-size", 128, 16), ("--num-attention-heads", 4, 2),
    )
    assert plan.spec.args.num_query_groups == 2 and plan.spec.vocab_size == 128  # under the floor: kept
