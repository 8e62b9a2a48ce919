"""The oracle with fully trained modules (PEFT's modules_to_save, issue 19): every default topology still
equals world-1 when the vocab-parallel output layer (and, dense, the embedding) trains fully beside the
adapters; their grads and deltas are compared like the adapters' (the driver captures every trainable
parameter, `testbed.shards` puts the vocabulary shards back together). The world-1 run is checked to
really train them. Negative control: the output layer's grad left out of the DP sum (mutation
`trained_fully_outside_dp_sync`), caught on dp2 by >= 100x (measured 5.0e3 x its threshold).

Tied embeddings (one weight; under PP the last stage's copy, summed with the embedding's grad over
first and last stage by Megatron's finalize) pass the dense topologies; skipping that sum is caught on
pp2 (measured 3.7e3 x the grad-norm threshold).

Measured (fp32, seed 1234, output_layer + word_embeddings): worst grads 4.9e-6 (tp2, threshold 1e-4),
deltas 3.3e-5 (tp2, threshold 1e-3); MoE ep2 / tp2-etp2-sp grads <= 1.3e-6; tied grads <= 1.9e-6: the
noise of the adapter-only runs.
"""

from __future__ import annotations

from test_oracle_lora_options import DENSE_TOPOLOGIES, MOE_TOPOLOGIES

from megatron_lora_patch.cli.oracle import DEFAULT_TOPOLOGIES
from megatron_lora_patch.proof.oracle import harness, known_bugs_sync, phases
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS, Mutation
from megatron_lora_patch.proof.testbed.topology import Topology

BOTH = (("modules_to_save", ("output_layer", "word_embeddings")),)
OUTPUT_LAYER = (("modules_to_save", ("output_layer",)),)
WEIGHTS = {"output_layer.weight", "embedding.word_embeddings.weight"}


def _trained_base_weights(settings: harness.OracleSettings) -> set:
    """The non-adapter parameters the world-1 run of `settings` trains (captures hold trainable ones only)."""
    (records, error), = harness._run_isolated([harness.make_job(Topology.parse("tp1"), settings)], timeout=600)
    assert error is None, error
    return {name for name in phases.adapter_shapes(records) if ".lora." not in name}


def _check(report, topologies) -> None:
    print(report.table())
    assert report.passed and len(report.topologies) == len(topologies), report.table()
    for result in report.mutations:
        assert result.caught and result.worst_ratio >= 100, report.table()


def test_dense_topologies_match_world1_with_output_layer_and_embedding_trained_fully():
    settings = harness.OracleSettings(model="dense", lora_options=BOTH)
    assert _trained_base_weights(settings) == WEIGHTS
    assert _trained_base_weights(harness.OracleSettings(model="dense")) == set()
    report = harness.run_oracle(DENSE_TOPOLOGIES, [MUTATIONS["trained_fully_outside_dp_sync"]], settings=settings)
    _check(report, DENSE_TOPOLOGIES)
    assert len(report.mutations) == 1


def test_moe_topologies_match_world1_with_the_output_layer_trained_fully():
    settings = harness.OracleSettings(model="moe", lora_options=OUTPUT_LAYER)
    report = harness.run_oracle(MOE_TOPOLOGIES, settings=settings)
    _check(report, MOE_TOPOLOGIES)
    assert set(DENSE_TOPOLOGIES + MOE_TOPOLOGIES) == set(DEFAULT_TOPOLOGIES)


#: Not in the registry: the default (untied) oracle model has no tied embedding to sync.
SKIP_TIED_SYNC = Mutation(
    "skip_tied_embedding_grad_sync",
    "The tied word-embedding grads are not all-reduced over the first and last pipeline stage.",
    "pp2",
    install=known_bugs_sync.skip_tied_embedding_grad_sync,
)


def test_tied_embeddings_train_as_one_weight_on_every_dense_topology():
    """Tied: naming the output layer trains the one shared weight (the embedding, and under PP the last
    stage's copy, summed over both stages by Megatron's finalize); skipping that sum is caught on pp2."""
    settings = harness.OracleSettings(model="dense", tie_embeddings=True, lora_options=OUTPUT_LAYER)
    assert _trained_base_weights(settings) == {"embedding.word_embeddings.weight"}
    report = harness.run_oracle(DENSE_TOPOLOGIES, [SKIP_TIED_SYNC], settings=settings)
    _check(report, DENSE_TOPOLOGIES)
    assert len(report.mutations) == 1
