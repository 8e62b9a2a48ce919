"""`oracle --model mla`: LoRA on every multi-latent-attention linear matches world size 1 under TP + SP,
with the query down / up projections (DeepSeek-V3) and with one `linear_q_proj` (`q_lora_rank` unset).
The MLA mutations run with the others in tests/test_oracle_mutations.py; dp2 / pp2 / tp4-sp pass too
(`megatron-lora-patch oracle --model mla --topologies tp2,tp2-sp,dp2,pp2,tp4-sp`, docs/testing.md)."""

from __future__ import annotations

import pytest

from megatron_lora_patch.proof.oracle import harness
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-down-up", "q-proj"])
def test_mla_matches_world1_on_tp2_sp(monkeypatch, q_lora_rank):
    monkeypatch.setattr(harness, "MLA", TinyGPTSpec.mla(q_lora_rank=q_lora_rank, num_layers=2))
    report = harness.run_oracle(["tp2-sp"], (), harness.OracleSettings(model="mla"))
    print(report.table())
    [result] = report.topologies
    assert result.model == "mla" and result.passed, report.table()
