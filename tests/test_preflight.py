"""`megatron-lora-patch preflight -- <pretrain_gpt.py arguments>`: the oracle on the user's model and topology.

Megatron-LM-style argument lists (a dense GQA model, an MoE model with a dense first layer),
two ranks each, tiny widths, 2 steps: the user's topology must match world-1, and with one
of the oracle's mutations active the preflight must fail and name the layer.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import assert_one_line_error

if importlib.util.find_spec("megatron.training") is None:  # absent only: an import error in it must fail
    pytest.skip(
        "preflight parses with Megatron-LM's argument parser: megatron.training is absent (megatron-core < 0.17)",
        allow_module_level=True,
    )

from preflight_cases import (  # noqa: E402
    DENSE,  # noqa: F401 (fixture)
    MOE,
    PHASES,
    TP2_SP,
    assert_passed,
    cli,
    options,
    preflight_environ,
    user_environ,  # noqa: F401 (fixture)
)

from megatron_lora_patch.proof.oracle import preflight, preflight_run
from megatron_lora_patch.runtime.errors import UsageError


def test_dense_gqa_tp2_sp_passes_and_reports_json(tmp_path):
    """The README's command: exit 0, one depth-cut layer said, the verdict last, the JSON report."""
    report_path = tmp_path / "preflight.json"
    result = cli("--json", str(report_path), "--", *DENSE, *TP2_SP, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "layers: 1 of your 4 (every layer kind once: 0: dense); widths unchanged" in result.stdout
    assert lines[-1].startswith("PASS: 1/1 topologies match world-1")
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["drift"] is None
    assert report["preflight"]["topology"] == "tp2-sp" and report["preflight"]["width"]["hidden"] == 64
    assert {change["setting"] for change in report["preflight"]["changed"]} >= {
        "hidden_dropout",
        "MEGATRON_LORA_B_INIT",
    }
    assert set(report["topologies"][0]["phases"]) == PHASES


def test_skipped_tp_sum_fails_and_names_the_layer(tmp_path):
    """The negative control: the column-parallel A's TP SUM left out must FAIL (exit 1) by >= 100x, naming layer 0."""
    report_path = tmp_path / "preflight.json"
    result = cli(
        "--json", str(report_path), "--mutation", "skip_tp_sum_column_a", "--", *DENSE, *TP2_SP, tmp_path=tmp_path
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("FAIL: 0/1 topologies match world-1")
    drift = json.loads(report_path.read_text())["drift"]
    assert drift["over_threshold"] >= 100 and drift["layer"] == 0 and drift["layer_kind"] == "dense"
    assert "linear_qkv" in drift["parameter"] or "linear_fc1" in drift["parameter"]
    assert "drifts most: phase " in result.stdout and "layer 0 (dense)" in result.stdout


def test_dense_pp2_passes(user_environ):
    plan = preflight.make_plan(options([*DENSE, "--pipeline-model-parallel-size", "2"]))
    assert_passed(preflight_run.run_plan(plan), "pp2", ["dense", "dense"])


def test_moe_ep2_passes(user_environ):
    plan = preflight.make_plan(options([*MOE, "--expert-model-parallel-size", "2"]))
    assert_passed(preflight_run.run_plan(plan), "ep2", ["dense", "moe"])


def test_moe_tp2_etp2_sp_passes_and_a_skipped_expert_sum_names_the_moe_layer(user_environ):
    arguments = [*MOE, *TP2_SP, "--expert-tensor-parallel-size", "2"]
    assert_passed(preflight_run.run_plan(preflight.make_plan(options(arguments))), "tp2-etp2-sp", ["dense", "moe"])
    report = preflight_run.run_plan(preflight.make_plan(options(arguments, mutation="skip_expert_tp_sum")))
    assert not report.passed
    assert report.drift["layer"] == 1 and report.drift["layer_kind"] == "moe", report.drift
    assert "experts" in report.drift["parameter"] and report.drift["over_threshold"] >= 100


@pytest.mark.parametrize(
    "arguments, overrides, message",
    [
        (
            DENSE,
            {},
            "your arguments run on one rank, so there is nothing to compare with world size 1; pass your "
            "parallel sizes (--tensor-model-parallel-size, --pipeline-model-parallel-size, ...) "
            "or --data-parallel-size N before -- (on a GPU node, --device cuda also checks one rank's kernels)",
        ),
        (
            [*DENSE, *TP2_SP, "--num-layers", "x"],
            {},
            "Megatron-LM rejects the arguments: pretrain_gpt.py: error: argument --num-layers: invalid int value: 'x'",
        ),
        (
            [*DENSE, *TP2_SP, "--num-attention-heads", "5"],
            {},
            "Megatron-LM rejects the arguments: failed check `assert args.hidden_size % args.num_attention_heads == 0`",
        ),
        (
            [*DENSE, "--pipeline-model-parallel-size", "2"],
            {"layers": 3},
            "--layers 3 is not divisible by the pipeline size 2; use a multiple of 2",
        ),
        (
            [*MOE, "--expert-model-parallel-size", "2"],
            {"layers": 1},
            "--layers 1 cannot hold every layer kind (dense, moe); use --layers 2 or more",
        ),
        (
            [*DENSE, *TP2_SP],
            {"mutation": "skip_expert_tp_sum"},
            "mutation skip_expert_tp_sum needs a MoE model (--num-experts); your arguments have no --num-experts",
        ),
        (
            [*MOE, *TP2_SP],
            {"mutation": "expert_bias_from_local_counts"},
            "mutation expert_bias_from_local_counts needs a MoE router with the expert bias "
            "(--moe-router-enable-expert-bias); your arguments have no --moe-router-enable-expert-bias",
        ),
        (  # a mutation the topology cannot expose would only pass (proof/oracle/exposure.py)
            [*DENSE, "--pipeline-model-parallel-size", "2"],
            {"mutation": "skip_tp_sum_column_a"},
            "mutation skip_tp_sum_column_a changes nothing without tensor parallelism (your topology: pp2); use "
            "--tensor-model-parallel-size 2 or more",
        ),
        (
            [*DENSE, *TP2_SP],
            {"mutation": "local_token_normalization"},
            "mutation local_token_normalization changes nothing without data parallelism or context parallelism "
            "(your topology: tp2-sp); use the preflight's --data-parallel-size 2 or more; or --context-parallel-size "
            "2 or more",
        ),
        (
            MOE,
            {"mutation": "expert_grads_over_dense_dp", "data_parallel_size": 2},
            "mutation expert_grads_over_dense_dp changes nothing without an expert data-parallel group other than "
            "the dense one (your topology: dp2); use --expert-model-parallel-size x --expert-tensor-parallel-size "
            "(it defaults to the TP size) other than --tensor-model-parallel-size, e.g. --expert-model-parallel-size 2",
        ),
        (
            [*DENSE, *TP2_SP],
            {"mutation": "lora_input_grad_outside_collective"},
            "mutation lora_input_grad_outside_collective does not model sequence parallelism (your topology: "
            "tp2-sp); run it with no --sequence-parallel",
        ),
        (
            [*DENSE, *TP2_SP, "--fp16"],
            {},
            "preflight does not support fp16 loss scaling (compare in --bf16 or fp32) yet: "
            "drop --fp16 for the preflight",
        ),
        ([], {}, "preflight needs your pretrain_gpt.py arguments after --, e.g. preflight -- --num-layers 32 ..."),
        (
            [*DENSE, "--tensor-model-parallel-size", "2", "--sequence-paralel"],
            {},
            "Megatron-LM rejects the arguments: pretrain_gpt.py: error: unrecognized arguments: --sequence-paralel; "
            "did you mean --sequence-parallel?",
        ),
        (
            [*DENSE, *TP2_SP, "--my-own-flag", "1"],
            {},
            "Megatron-LM rejects the arguments: pretrain_gpt.py: error: unrecognized arguments: --my-own-flag 1; "
            "leave out the arguments your own script adds",
        ),
        (  # refused as the user's run refuses it, not as Megatron-LM checks FSDP's CUDA_DEVICE_MAX_CONNECTIONS
            [*DENSE, *TP2_SP, "--use-torch-fsdp2"],
            {},
            "LoRA is not supported with --use-torch-fsdp2: the adapters' grad sync, grad norm and checkpoints are "
            "proven with Megatron's DistributedDataParallel only; leave out --use-torch-fsdp2 "
            "(--use-distributed-optimizer shards the optimizer state)",
        ),
        (
            [*MOE, *TP2_SP, "--expert-tensor-parallel-size", "2", "--moe-ffn-hidden-size", "65"],
            {},
            "Megatron-Core rejects this model: --moe-ffn-hidden-size 65 is not divisible by "
            "--expert-tensor-parallel-size 2 (its linears are split over those ranks); choose sizes that divide",
        ),
    ],
)
def test_bad_input_is_one_usage_error(user_environ, arguments, overrides, message):
    with pytest.raises(UsageError) as caught:
        preflight.make_plan(options(arguments, **overrides))
    assert str(caught.value) == message


def test_too_large_for_this_machine_says_so_and_offers_fewer_layers(user_environ):
    """Never a silent pass: a world-1 model over the memory limit stops with the smallest comparison that fits."""
    from megatron_lora_patch.proof.testbed.args_cuts import estimate_parameters

    full = preflight.make_plan(options([*MOE, "--expert-model-parallel-size", "2"], layers=4))
    minimal = preflight.make_plan(options([*MOE, "--expert-model-parallel-size", "2"]))
    between = (estimate_parameters(full.spec) + estimate_parameters(minimal.spec)) * 4  # fp32 x2, in bytes
    with pytest.raises(
        UsageError,
        match=r"the world-1 reference cannot fit: .* use --layers 2 \(the fewest that hold every layer kind\)$",
    ):
        preflight.make_plan(
            options([*MOE, "--expert-model-parallel-size", "2"], layers=4, max_memory_gib=between / 2**30)
        )
    with pytest.raises(UsageError, match="even the fewest layers do not fit at these widths"):
        preflight.make_plan(options([*MOE, "--expert-model-parallel-size", "2"], max_memory_gib=1e-6))


def test_ffn_that_tp_does_not_divide_is_one_line_exit_2_before_any_rank(tmp_path):
    """Megatron asserts `800 is not divisible by 3` only when each rank builds the layer (was a numerical FAIL,
    exit 1); the preflight says so before any rank starts. Control: the same model at TP 2 plans fine."""
    arguments = [*DENSE, "--ffn-hidden-size", "131", *TP2_SP]
    result = cli("--", *arguments, tmp_path=tmp_path)
    message = (
        "Megatron-Core rejects this model: --ffn-hidden-size 131 is not divisible by --tensor-model-parallel-size 2 "
        "(its linears are split over those ranks); choose sizes that divide"
    )
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""


def test_summary_echoes_the_lora_settings_tested(user_environ, monkeypatch):
    monkeypatch.setenv("MEGATRON_LORA_RANK", "8")
    monkeypatch.setenv("MEGATRON_LORA_TARGETS", "linear_qkv,linear_fc2")
    summary = preflight.make_plan(options([*DENSE, *TP2_SP])).summary().splitlines()
    assert "  LoRA (from your environment): rank 8, alpha 32, targets linear_qkv,linear_fc2" in summary


def test_bad_lora_environment_is_one_line_exit_2(tmp_path):
    environ = preflight_environ() | {"MEGATRON_LORA_RANK": "abc"}
    command = [sys.executable, "-P", "-m", "megatron_lora_patch", "preflight", "--", *DENSE, *TP2_SP]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environ)
    assert_one_line_error(result, "MEGATRON_LORA_RANK must be a positive integer, got 'abc'", returncode=2)


def _corpus(tmp_path, vocab_size: int = 128, sequences: int = 40, length: int = 50) -> str:
    """A Megatron indexed dataset (PREFIX.bin / .idx) of seeded token ids below `vocab_size`; its prefix."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    generator = torch.Generator().manual_seed(7)
    for _ in range(sequences):
        builder.add_document(torch.randint(0, vocab_size, (length,), generator=generator), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def _with_data(arguments: list, *data_path: str) -> list:
    return [item for item in arguments if item != "--mock-data"] + ["--data-path", *data_path]


def test_data_path_feeds_both_runs_the_first_tokens_and_passes(user_environ, tmp_path):
    """--data-path (a weighted blend: the first prefix) replaces the mock tokens in every step's batch."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_lora_patch.proof.testbed import driver
    from megatron_lora_patch.proof.testbed import settings as testbed_settings

    prefix = _corpus(tmp_path)
    plan = preflight.make_plan(options(_with_data([*DENSE, *TP2_SP], "1.0", prefix)))
    assert plan.data_path == prefix and plan.describe()["data"] == prefix
    settings = testbed_settings.TrainSettings(steps=2, global_batch_size=4, data_path=prefix)
    batches = driver._global_batches(plan.spec, settings)
    per_step = 4 * (plan.spec.seq_length + 1)
    first = _first_tokens(IndexedDataset(prefix), 2 * per_step)
    for step, batch in enumerate(batches):
        expected = first[step * per_step : (step + 1) * per_step].reshape(4, -1)
        assert (batch["tokens"] == expected[:, :-1]).all() and (batch["labels"] == expected[:, 1:]).all()
    mock = driver._global_batches(plan.spec, testbed_settings.TrainSettings(steps=1, global_batch_size=4))
    assert not (mock[0]["tokens"] == batches[0]["tokens"]).all()  # control: the data path changed the tokens
    assert_passed(preflight_run.run_plan(plan), "tp2-sp", ["dense"])


def test_the_budget_cut_keeps_the_vocabulary_of_real_data(user_environ, tmp_path):
    """Tokens of a --data-path need the user's vocabulary: the cut narrows the widths instead. Control: the same
    model on mock data gets its vocabulary cut."""
    wide = [*DENSE[: DENSE.index("--vocab-size")], "--vocab-size", "4096", *TP2_SP]
    real = preflight.make_plan(options(_with_data(wide, _corpus(tmp_path)), max_parameters=0.1))
    assert real.spec.padded_vocab_size == 4096 and real.spec.cuts and "--vocab-size" not in dict(
        (option, run) for option, _, run in real.spec.cuts
    )
    mock = preflight.make_plan(options(wide, max_parameters=0.3))
    assert mock.spec.cuts == (("--vocab-size", 4096, 2048),)  # only as far as needed: no width cut


def _first_tokens(dataset, count: int):
    """The dataset's first `count` token ids, sequences in order (independent of testbed.data.read_corpus)."""
    import numpy
    import torch

    return torch.from_numpy(
        numpy.concatenate([dataset[index] for index in range(len(dataset))])[:count].astype("int64")
    )


def test_bad_data_path_is_one_usage_error(user_environ, tmp_path):
    with pytest.raises(UsageError, match=r"--data-path .*missing\.bin and .*missing\.idx not found \(give the prefix"):
        preflight.make_plan(options(_with_data([*DENSE, *TP2_SP], str(tmp_path / "missing"))))
    wide = _corpus(tmp_path, vocab_size=1000)
    with pytest.raises(UsageError, match=r"token id \d+ is outside your vocabulary of 128; was it tokenized"):
        preflight.make_plan(options(_with_data([*DENSE, *TP2_SP], wide)))
    short = _corpus(tmp_path, sequences=1)
    with pytest.raises(UsageError, match=r"holds 50 tokens, the preflight needs \d+; use fewer --steps"):
        preflight.make_plan(options(_with_data([*DENSE, *TP2_SP], short)))


def test_dense_dp2_distributed_optimizer_passes_and_ddp_averaging_on_top_fails(user_environ):
    """`--use-distributed-optimizer` runs as given (reduce-scattered grads, sharded optimizer state) against a
    world-1 reference with the plain optimizer; the negative control (DDP also averaging over DP) fails >= 100x."""
    arguments = [*DENSE, "--use-distributed-optimizer"]
    plan = preflight.make_plan(options(arguments, data_parallel_size=2))
    assert "use_distributed_optimizer" not in {change["setting"] for change in plan.describe()["changed"]}
    assert_passed(preflight_run.run_plan(plan), "dp2", ["dense"])
    report = preflight_run.run_plan(
        preflight.make_plan(options(arguments, data_parallel_size=2, mutation="ddp_average_on_top"))
    )
    assert not report.passed and report.drift["over_threshold"] >= 100, report.table()
