"""A MoE adapter with its own rank and alpha per kind, end to end (issue 29; docs/handoff.md sections 1-4).

The configuration comes from the variables (`MEGATRON_LORA_RANK_PATTERN` / `_ALPHA_PATTERN`, parsed as at
plugin activation): attention r 8 / alpha 16, routed experts' fc1 (gate_up) r 4 / alpha 6 and fc2 (down)
r 6 / alpha 3, shared experts r 12 / alpha 24. A Qwen2-MoE-style model (4 routed experts, shared experts
with a gate) trains 2 Adam steps at EP2 and at TP2 + ETP2 + SP, takes `adapter_state(family="qwen2_moe")`
and writes an adapter-only checkpoint, exported by the CLI. Proven, fp32, 1e-5 of the largest logit:
the in-memory state is the export byte for byte, with per-kind pattern keys (`experts.down_proj` beside
`shared_expert.down_proj`); peft gives Megatron's logits (controls: two kinds' alphas exchanged > 100x off,
two kinds' ranks exchanged refused by peft); the `per_expert` layout with its re-keyed patterns, read
with PEFT's pattern rule, gives them too; the SGLang and vLLM payloads (one r, scaling folded into B),
read as each engine reads them (`engine_loaders`), give them (control: lora_alpha halved); the export
imported at the other topology exports again byte for byte.
"""

from __future__ import annotations

import os

import engine_loaders
import handoff_worker
import hf_qwen2_moe
import persistence_worker
import pytest
import resume_worker
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch import handoff
from megatron_lora_patch.lora.exchange import files as peft_files
from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.runtime.errors import UsageError

SPEC = TinyGPTSpec.moe(moe_ffn_hidden_size=32)
LOGITS_TOLERANCE = 1e-5
KINDS = {"*self_attention*": (8, 16.0), "*local_experts*linear_fc1": (4, 6.0), "*local_experts*linear_fc2": (6, 3.0),
         "*shared_experts*": (12, 24.0)}
ENVIRON = {
    "MEGATRON_LORA_RANK": "2", "MEGATRON_LORA_ALPHA": "8", "MEGATRON_LORA_B_INIT": "nonzero",
    "MEGATRON_LORA_SEED": "29",
    "MEGATRON_LORA_RANK_PATTERN": ",".join(f"{key}={rank}" for key, (rank, _) in KINDS.items()),
    "MEGATRON_LORA_ALPHA_PATTERN": ",".join(f"{key}={alpha}" for key, (_, alpha) in KINDS.items()),
}
#: the same configuration as LoraConfig fields (for `handoff_worker.state_world`, which imports)
OPTIONS = {"rank": 2, "rank_pattern": {key: rank for key, (rank, _) in KINDS.items()},
           "alpha_pattern": {key: alpha for key, (_, alpha) in KINDS.items()}}
OTHER = {"ep2": "tp2-etp2-sp", "tp2-etp2-sp": "ep2"}
RANKS = {"q_proj": 8, "k_proj": 8, "v_proj": 8, "o_proj": 8, "gate_up_proj": 4, "experts.down_proj": 6,
         "gate_proj": 12, "up_proj": 12, "shared_expert.down_proj": 12}


@pytest.fixture(scope="module", params=list(OTHER))
def trained(request, tmp_path_factory):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    root = tmp_path_factory.mktemp(f"ranks-{request.param}")
    args = (request.param, SPEC, ENVIRON, 2, str(root / "checkpoint"), "qwen2_moe")
    rank = run_world(handoff_worker.train_state_world, 2, args=args, name=request.param, timeout=300)[0]
    export_peft(str(root / "checkpoint"), str(root / "export"), "qwen2_moe")
    state = handoff.AdapterState(rank["config"], rank["tensors"], "qwen2_moe")
    return {"root": root, "topology": request.param, "state": state, "logits": rank["logits"]}


def _hf():
    return hf_qwen2_moe.qwen2_moe_for(SPEC, resume_worker.SETTINGS.seed)


def _error(trained, logits) -> float:
    return max_abs_error_over_max(logits, trained["logits"])


def _peft_logits(config: dict, tensors: dict) -> torch.Tensor:
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    model = get_peft_model(_hf(), PeftConfig.from_peft_type(**config))
    assert not set_peft_model_state_dict(model, tensors).unexpected_keys
    with torch.no_grad():
        return model.eval()(persistence_worker.batch(SPEC)[0]).logits


def _read(trained, reader, tensors: dict, config: dict) -> float:
    with torch.no_grad():
        return _error(trained, reader(_hf(), tensors, config)(persistence_worker.batch(SPEC)[0]).logits)


def test_state_is_the_export_byte_for_byte_with_per_kind_pattern_keys(trained):
    state = trained["state"]
    assert state.config["r"] == 2 and state.config["rank_pattern"] == RANKS
    assert state.config["alpha_pattern"] == {**{key: 16.0 for key in ("q_proj", "k_proj", "v_proj", "o_proj")},
                                             "gate_up_proj": 6.0, "experts.down_proj": 3.0, "gate_proj": 24.0,
                                             "up_proj": 24.0, "shared_expert.down_proj": 24.0}
    assert state.tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"].shape == (64, 6 * 4)
    peft_files.write(str(trained["root"] / "memory"), state.tensors, state.config, "qwen2_moe")
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        memory = open(os.path.join(trained["root"], "memory", name), "rb").read()
        assert memory == open(os.path.join(trained["root"], "export", name), "rb").read(), name


def test_peft_gives_megatron_logits_and_exchanged_kinds_do_not(trained):
    config, tensors = trained["state"].config, trained["state"].tensors
    error = _error(trained, _peft_logits(config, tensors))
    print(f"peft, per-kind ranks ({trained['topology']}): {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    alphas = {**config["alpha_pattern"], "q_proj": 24.0, "gate_proj": 16.0}  # attention <-> shared experts (q, gate)
    control = _error(trained, _peft_logits({**config, "alpha_pattern": alphas}, tensors))
    print(f"control, alphas exchanged: {control:.3e}")
    assert control > 100 * LOGITS_TOLERANCE
    ranks = {**config["rank_pattern"], "gate_up_proj": 6, "experts.down_proj": 4}  # routed fc1 <-> fc2
    with pytest.raises(RuntimeError, match="size mismatch"):
        _peft_logits({**config, "rank_pattern": ranks}, tensors)


def test_per_expert_layout_with_re_keyed_patterns_gives_megatron_logits(trained):
    converted = handoff.convert(trained["state"], "per_expert")
    patterns = converted.config["rank_pattern"]
    assert patterns[r"experts.\d+.down_proj"] == 6 and patterns["shared_expert.down_proj"] == 12, patterns
    assert converted.tensors["base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight"].shape == (4, 64)
    error = _read(trained, engine_loaders.merge, converted.tensors, converted.config)
    print(f"per-expert reader, PEFT's pattern rule: {error:.3e}")
    assert error <= LOGITS_TOLERANCE


def test_engine_payloads_read_as_each_engine_give_megatron_logits(trained):
    converted = handoff.convert(trained["state"], "per_expert")
    sglang = handoff.sglang_payload(converted, "policy")
    assert (sglang["config_dict"]["r"], sglang["config_dict"]["rank_pattern"]) == (12, {})
    vllm = handoff.vllm_payload(converted, "policy", 1)
    readers = (("SGLang", engine_loaders.sglang_merge, sglang["tensors"], sglang["config_dict"]),
               ("vLLM", engine_loaders.vllm_merge, vllm["lora_tensors"], vllm["peft_config"]))
    for name, reader, tensors, config in readers:
        error = _read(trained, reader, tensors, config)
        print(f"{name} reader, one r and folded scaling: {error:.3e}")
        assert error <= LOGITS_TOLERANCE
    halved = {**sglang["config_dict"], "lora_alpha": 6.0}
    control = _read(trained, engine_loaders.sglang_merge, sglang["tensors"], halved)
    print(f"control, lora_alpha halved: {control:.3e}")
    assert control > 100 * LOGITS_TOLERANCE
    with pytest.raises(ValueError, match="ignore rank_pattern"):  # the unfolded state, as SGLang would read it
        engine_loaders.sglang_merge(_hf(), converted.tensors, converted.config)
    for call, text in ((lambda: handoff.sglang_payload(trained["state"], "p"), "not peft's packed target_parameters"),
                       (lambda: handoff.vllm_payload(trained["state"], "p", 1), "pass handoff.convert")):
        with pytest.raises(UsageError, match=text) as refused:
            call()
        assert "\n" not in str(refused.value)


def test_import_at_the_other_topology_exports_the_same_bytes(trained):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    other, root = OTHER[trained["topology"]], trained["root"]
    args = (other, SPEC, 999, str(root / "again"), "qwen2_moe", OPTIONS, True, str(root / "export"))
    again = run_world(handoff_worker.state_world, 2, args=args, name=other, timeout=300)[0]["tensors"]
    assert list(again) == list(trained["state"].tensors)
    export_peft(str(root / "again"), str(root / "export-again"), "qwen2_moe")
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        first = open(os.path.join(root, "export", name), "rb").read()
        assert first == open(os.path.join(root, "export-again", name), "rb").read(), name
