"""`oracle --model mla`: LoRA on every multi-latent-attention linear matches world size 1 under TP + SP and
CP, with the query down / up projections (DeepSeek-V3) and with one `linear_q_proj` (`q_lora_rank` unset).
The MLA mutations run with the others in tests/test_oracle_mutations.py; tp2, dp2, pp2, tp2-cp2 and tp4-sp
pass too (`megatron-lora-patch oracle --model mla --topologies ...`, run by hand: CI time)."""

from __future__ import annotations

import pytest

from megatron_lora_patch.proof.oracle import harness
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec


@pytest.mark.parametrize("q_lora_rank, topologies", [(24, ["tp2-sp", "cp2"]), (None, ["tp2-sp"])],
                         ids=["q-down-up", "q-proj"])
def test_mla_matches_world1(monkeypatch, q_lora_rank, topologies):
    monkeypatch.setitem(harness.MODELS, "mla", TinyGPTSpec.mla(q_lora_rank=q_lora_rank, num_layers=2))
    report = harness.run_oracle(topologies, (), harness.OracleSettings(model="mla"))
    print(report.table())
    assert [result.model for result in report.topologies] == ["mla"] * len(topologies)
    assert all(result.passed for result in report.topologies), report.table()
