"""`layout_invariant`: one mode, one name, and its refusals (docs/architecture.md section 7).

- the former name `tp_invariant` still works everywhere a patch is named (the `enable`
  argument, `MEGATRON_LORA_PATCH_TP_INVARIANT`, `MEGATRON_LORA_DISABLED_PATCHES`) and in the
  oracle (`--tp-invariant`), each with a one-line deprecation warning;
- `--layout-invariant` runs 26 layouts by default: tp 1/2/4 x dp 1/2/4 x pp 1/2 with and without
  sp, at most 8 ranks, and MoE at ep 2/4 (with dp4, pp2) and etp 1/2, at tp2 with etp2 (ep 1 and 2), at a global
  batch of two microbatches per lane;
- what the mode does not cover stops the run with one line naming the fix, before any
  optimizer step (a real world of one rank, real TransformerConfigs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import LANES
from megatron_lora_patch.runtime import flags

DEFAULTS = {"lora_linear": True, "layout_invariant": False}


def test_the_former_patch_name_works_with_one_deprecation_line(caplog):
    flags._warned_renames.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_lora_patch"):
        decided = flags.resolve_enabled(DEFAULTS, {"tp_invariant": True}, environ={})
    assert decided["layout_invariant"] == (True, "arg")
    (line,) = [record.getMessage() for record in caplog.records]
    assert "'tp_invariant' is deprecated; it now means 'layout_invariant'" in line and "\n" not in line


def test_the_former_variable_and_disabled_entry_work():
    old = flags.patch_variable("tp_invariant")
    flags.check_variable_names(DEFAULTS, (), environ={old: "1"})
    assert flags.resolve_enabled(DEFAULTS, environ={old: "1"})["layout_invariant"] == (True, "env")
    disabled = {flags.DISABLED_VARIABLE: "tp_invariant"}
    assert flags.resolve_enabled({**DEFAULTS, "layout_invariant": True}, environ=disabled)["layout_invariant"] == (
        False, "env")
    both = {old: "1", flags.patch_variable("layout_invariant"): "yes"}
    assert flags.resolve_enabled(DEFAULTS, environ=both)["layout_invariant"] == (True, "env")


@pytest.mark.parametrize("former, new", [("1", "0"), ("0", "1")])
def test_the_former_and_new_variable_disagreeing_is_one_line(former, new):
    """Was silent: the new variable won, so TP_INVARIANT=1 with LAYOUT_INVARIANT=0 left the mode off."""
    environ = {flags.patch_variable("tp_invariant"): former, flags.patch_variable("layout_invariant"): new}
    with pytest.raises(flags.FlagError) as refused:
        flags.resolve_enabled(DEFAULTS, environ=environ)
    on, off = ("on", "off") if former == "1" else ("off", "on")
    assert str(refused.value) == (
        f"MEGATRON_LORA_PATCH_TP_INVARIANT turns layout_invariant {on} but MEGATRON_LORA_PATCH_LAYOUT_INVARIANT "
        f"turns it {off}; remove one of the two (MEGATRON_LORA_PATCH_TP_INVARIANT is its former name)"
    )


def _oracle_arguments(*extra: str) -> argparse.Namespace:
    from megatron_lora_patch.cli import oracle as command

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser.parse_args(["oracle", *extra])


def test_oracle_flag_its_deprecated_alias_and_its_default_matrix(capsys):
    from megatron_lora_patch.cli import oracle as command
    from megatron_lora_patch.proof.testbed.topology import Topology

    topologies, _, settings = command.check_arguments(_oracle_arguments("--tp-invariant"))
    assert settings.layout_invariant and "--tp-invariant is deprecated" in capsys.readouterr().err
    assert command.check_arguments(_oracle_arguments("--layout-invariant"))[2] == settings
    parsed = [Topology.parse(text) for text in topologies]
    assert len(set(topologies)) >= 16 and max(topology.world_size for topology in parsed) <= 8
    assert {t.tp for t in parsed} | {1} == {1, 2, 4} and {t.dp for t in parsed} | {1} == {1, 2, 4, 8}
    assert {t.pp for t in parsed} == {1, 2} and {t.sp for t in parsed} == {False, True}
    assert {t.ep for t in parsed} == {1, 2, 4} and {t.etp for t in parsed} == {1, 2}
    assert {(t.tp, t.ep) for t in parsed if t.etp == 2} >= {(2, 1), (2, 2), (1, 2), (1, 4)}  # MoE at tp2 too
    assert settings.global_batch_size == 2 * LANES


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, calculate_per_token_loss=True,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **overrides})


@pytest.mark.parametrize("overrides, fix", [
    ({"calculate_per_token_loss": False}, "enable the loss_normalization patch (or calculate_per_token_loss)"),
    ({"hidden_dropout": 0.1}, "set hidden_dropout=0 and attention_dropout=0"),
])
def test_training_refusals_name_the_fix(overrides, fix):
    import torch

    from megatron_lora_patch.layout_invariant import checks

    with pytest.raises(LayoutInvariantUnsupported, match="^layout_invariant: .*" + fix.replace("(", r"\(")
                       .replace(")", r"\)")):
        checks.check_training(_config(**overrides), torch.nn.Linear(2, 2))


def _with_dropout(chunks) -> None:
    for chunk in chunks:
        chunk.config.hidden_dropout = 0.1


def test_a_refusal_stops_the_run_before_any_step():
    """A real one-rank training run in the mode with dropout switched on after the model build."""
    from megatron_lora_patch.proof.oracle import harness
    from megatron_lora_patch.proof.testbed.launcher import WorldError
    from megatron_lora_patch.proof.testbed.runner import run_jobs
    from megatron_lora_patch.proof.testbed.topology import Topology

    job = harness.make_job(Topology.parse("tp1"), harness.OracleSettings(layout_invariant=True, steps=1))
    job = dataclasses.replace(job, settings=dataclasses.replace(job.settings, on_model_built=_with_dropout))
    with pytest.raises(WorldError, match="layout_invariant: dropout draws its masks per rank"):
        run_jobs([job], timeout=300, warnings="ignore")
