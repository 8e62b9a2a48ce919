"""The `null_tokenizer` patch: with the flag on, `--vocab-size N` includes EOD (eod N-1, vocab_size N).

Both conventions on the installed core `NullTokenizer` (directly and through `build_tokenizer`),
Megatron-LM's training-side `_NullTokenizer` through the test double in
megatron_lm_null_tokenizer.py (imported under its real module name, so the runtime's post-import
hook patches it), the GPTDataset cache key under both conventions, revert, and the status row
(applied, and "already upstream" for a class that already counts EOD inside). Each test uses a
fresh `Runtime`, so the process-wide one stays untouched; applying before Megatron is imported
(the usual order, where the tokenizer modules import each other half way) runs in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import textwrap
import types

import megatron
import numpy
import pytest
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.utils import Split

pytest.importorskip(
    "megatron.core.tokenizers", reason="not applicable to this Megatron-Core: no megatron.core.tokenizers (0.13)"
)
import megatron_lm_null_tokenizer as doubles
from conftest import run_python
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

from megatron_lora_patch.patches import null_tokenizer as patch
from megatron_lora_patch.plugins import lora_correct
from megatron_lora_patch.runtime import flags as flags_module
from megatron_lora_patch.runtime.registry import Runtime, SkipPatch

N = 64
#: Where `build_tokenizer` lives: `tokenizers.text.utils` up to 0.16, `tokenizers.utils` from 0.17.
BUILD_TOKENIZER_MODULE = next(
    name
    for name in (
        "megatron.core.tokenizers.utils.build_tokenizer",
        "megatron.core.tokenizers.text.utils.build_tokenizer",
    )
    if importlib.util.find_spec(name.rsplit(".", 1)[0]) is not None
)
build_tokenizer = importlib.import_module(BUILD_TOKENIZER_MODULE).build_tokenizer
#: From 0.18 Megatron-Core's NullTokenizer counts EOD inside the vocabulary itself.
CORE_UPSTREAM = NullTokenizer(N).eod == N - 1
legacy_base = pytest.mark.skipif(
    not doubles.HAVE_LEGACY_BASE,
    reason="not applicable to this Megatron-Core: no legacy tokenizer base (0.17+), no training-side _NullTokenizer",
)
old_core = pytest.mark.skipif(
    CORE_UPSTREAM, reason="not applicable to this Megatron-Core: its NullTokenizer already counts EOD inside"
)


def enable(null_tokenizer=None) -> dict:
    """Every other patch off; this one as given (None: left to its default)."""
    names = [spec.name for spec in lora_correct.megatron_lora_patch_patches() if spec.name != patch.SPEC.name]
    flags = {name: False for name in names}
    if null_tokenizer is not None:
        flags[patch.SPEC.name] = null_tokenizer
    return flags


def row(rows):
    return next(r for r in rows if r.patch == patch.SPEC.name)


@pytest.fixture
def runtime(monkeypatch):
    monkeypatch.delenv(flags_module.patch_variable(patch.SPEC.name), raising=False)
    registry = Runtime()
    yield registry
    registry.revert()


@pytest.fixture
def training_module(tmp_path, monkeypatch):
    """install(class_name): make a double importable as megatron.training.tokenizer.tokenizer."""

    def install(class_name: str) -> None:
        doubles.install_training_module(tmp_path, class_name)
        monkeypatch.syspath_prepend(str(tmp_path))

    yield install
    for name in [name for name in sys.modules if name.split(".")[:2] == ["megatron", "training"]]:
        del sys.modules[name]
    if hasattr(megatron, "training"):
        del megatron.training


def built(vocab_size: int = N):
    """The tokenizer Megatron-LM's new tokenizer system builds for `--tokenizer-type NullTokenizer`."""
    # from 0.17 build_tokenizer pads the vocabulary unless padded_vocab_size is set (0.18: pad_vocab_size)
    args = types.SimpleNamespace(
        tokenizer_type="NullTokenizer", vocab_size=vocab_size, padded_vocab_size=128, pad_vocab_size=False
    )
    return build_tokenizer(args)


def mock_dataset(tokenizer) -> MockGPTDataset:
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        tokenizer=tokenizer,
        split="1,0,0",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    indices = numpy.arange(20, dtype=numpy.int32)
    return MockGPTDataset(MockGPTLowLevelDataset(tokenizer), None, indices, 10, Split.train, config)


def cache_key(tokenizer) -> str:
    """The hash GPTDataset names its cached index files with."""
    return mock_dataset(tokenizer).unique_description_hash


def assert_text_round_trip(tokenizer, tokenize="text_to_ids", detokenize="ids_to_text") -> None:
    assert getattr(tokenizer, tokenize)("3 1 4") == [3, 1, 4]
    assert getattr(tokenizer, detokenize)([3, 1, 4]) == "3 1 4"


def core_attributes() -> dict:
    return {
        "init": vars(NullTokenizer)["__init__"],
        "identifiers": vars(NullTokenizer)["unique_identifiers"],
        "wrapper identifiers": vars(MegatronTokenizerText)["unique_identifiers"],
    }


@old_core
def test_off_by_default_keeps_eod_outside_the_vocabulary(runtime):
    before = core_attributes()
    status = row(runtime.apply(["lora_correct"], enable=enable()))
    assert (status.state, status.source) == ("disabled", "default")
    assert core_attributes() == before
    for tokenizer in (NullTokenizer(N), built()):
        assert (tokenizer.vocab_size, tokenizer.eod) == (N + 1, N)


@old_core
def test_flag_on_counts_eod_inside_and_revert_restores(runtime):
    before = core_attributes()
    status = row(runtime.apply(["lora_correct"], enable=enable(True)))
    assert status.state == "applied"
    # the training-side module is not importable here: never patched, shown as not imported
    assert status.detail == f"not imported yet: {patch.TRAINING_MODULE}"

    for tokenizer in (NullTokenizer(N), NullTokenizer(vocab_size=N), built()):
        assert (tokenizer.vocab_size, tokenizer.eod) == (N, N - 1)
    assert_text_round_trip(NullTokenizer(N))
    assert_text_round_trip(built(), "tokenize", "detokenize")
    for tokenizer in (NullTokenizer(N), built()):  # Megatron-Core's own tokenizers have no vocabulary mapping
        with pytest.raises(NotImplementedError):
            tokenizer.inv_vocab
    # mock documents end with N-1; from 0.16 Megatron also wraps their tokens into the vocabulary
    # (up to 0.15 they count 1..length whatever the vocabulary, so only the EOD is ours to check)
    documents = MockGPTLowLevelDataset(built())
    wraps_to_vocabulary = hasattr(documents, "vocab_size")
    for index in range(50):
        assert documents[index][-1] == N - 1
        assert documents[index].max() < N or not wraps_to_vocabulary
    with pytest.raises(ValueError, match="must be at least 1; got 0"):
        NullTokenizer(0)

    runtime.revert()
    assert core_attributes() == before
    assert (NullTokenizer(N).vocab_size, NullTokenizer(N).eod) == (N + 1, N)


@old_core
def test_cache_key_tells_the_conventions_apart(runtime):
    tokenizers = {"core": lambda: NullTokenizer(N), "built": built}
    default = {kind: cache_key(make()) for kind, make in tokenizers.items()}
    runtime.apply(["lora_correct"], enable=enable(True))
    patched = {kind: cache_key(make()) for kind, make in tokenizers.items()}
    description = json.loads(mock_dataset(built()).unique_description)
    assert description["tokenizer"]["eod_id"] == str(N - 1)
    assert json.loads(mock_dataset(NullTokenizer(N)).unique_description)["tokenizer"] == {
        "class": f"{NullTokenizer.__module__}.NullTokenizer",
        "vocab_size": N,
        "eod_id": N - 1,
    }
    assert patched == {kind: cache_key(make()) for kind, make in tokenizers.items()}  # deterministic
    runtime.revert()
    assert default == {kind: cache_key(make()) for kind, make in tokenizers.items()}
    for kind in tokenizers:
        assert patched[kind] != default[kind], kind


@old_core
@legacy_base
def test_training_side_class_is_patched_on_import(runtime, training_module):
    training_module("_NullTokenizer")
    default = importlib.import_module(patch.TRAINING_MODULE)._NullTokenizer(N)
    assert (default.vocab_size, default.eod) == (N + 1, N)
    del sys.modules[patch.TRAINING_MODULE]  # imported again below, after the patch is on
    original_init = vars(doubles._NullTokenizer)["__init__"]

    runtime.apply(["lora_correct"], enable=enable(True))
    module = importlib.import_module(patch.TRAINING_MODULE)
    assert (row(runtime.status()).state, row(runtime.status()).detail) == ("applied", "")
    tokenizer = module._NullTokenizer(N)
    assert (tokenizer.vocab_size, tokenizer.eod) == (N, N - 1)
    assert_text_round_trip(tokenizer, "tokenize", "detokenize")
    assert tokenizer.vocab[str(N - 1)] == tokenizer.eod == tokenizer.vocab_size - 1  # the double's mapping follows
    assert tokenizer.offsets([3, 14, 1], "3 14 1") == [0, 2, 5]
    assert tokenizer.unique_identifiers == {
        "class": "_NullTokenizer",
        "tokenizer_path": [None],
        "vocab_size": str(N),
        "eod_id": str(N - 1),
    }
    assert json.loads(tokenizer.unique_description) == tokenizer.unique_identifiers
    assert default.unique_identifiers == {"class": "_NullTokenizer", "tokenizer_path": [None], "vocab_size": str(N)}
    assert cache_key(tokenizer) != cache_key(default)

    runtime.revert()
    assert vars(doubles._NullTokenizer)["__init__"] is original_init
    assert module._NullTokenizer(N).eod == N


@old_core
@legacy_base
def test_class_already_counting_eod_is_reported_upstream(runtime, training_module):
    training_module("EodInVocabNullTokenizer")
    before = core_attributes()
    runtime.apply(["lora_correct"], enable=enable(True))
    module = importlib.import_module(patch.TRAINING_MODULE)
    status = row(runtime.status())
    assert status.state == "skipped"
    assert status.detail == f"already upstream: {patch.TRAINING_MODULE}._NullTokenizer(8) has vocab_size 8 and eod 7"
    # one state per patch: the core class, patched before the import, is reverted with it
    assert core_attributes() == before
    assert NullTokenizer(N).eod == N and module._NullTokenizer(N).eod == N - 1


def test_convention_probe():
    assert patch.require_eod_outside_vocab(doubles._NullTokenizer, "legacy") is None
    with pytest.raises(SkipPatch, match=r"^already upstream: upstream\(8\) has vocab_size 8 and eod 7$"):
        patch.require_eod_outside_vocab(doubles.EodInVocabNullTokenizer, "upstream")

    class PadAtEnd(doubles._NullTokenizer):
        @property
        def vocab_size(self):
            return self._ordinary_ids + 2

    with pytest.raises(RuntimeError, match=r"odd\(8\) has vocab_size 10 and eod 8, which is neither"):
        patch.require_eod_outside_vocab(PadAtEnd, "odd")


@pytest.mark.skipif(
    not CORE_UPSTREAM, reason="not applicable to this Megatron-Core: its NullTokenizer keeps EOD outside"
)
def test_core_class_counting_eod_is_reported_upstream(runtime):
    before = core_attributes()
    status = row(runtime.apply(["lora_correct"], enable=enable(True)))
    assert (status.state, status.detail) == (
        "skipped",
        f"already upstream: {patch.CORE_MODULE}.NullTokenizer(8) has vocab_size 8 and eod 7",
    )
    assert core_attributes() == before
    for tokenizer in (NullTokenizer(N), built()):
        assert (tokenizer.vocab_size, tokenizer.eod) == (N, N - 1)


@old_core
def test_applied_before_megatron_is_imported():
    code = textwrap.dedent(f"""
        import types, megatron_lora_patch
        from megatron_lora_patch.plugins import lora_correct
        megatron_lora_patch.apply(
            ["lora_correct"], enable={{name: name == "null_tokenizer" for name in lora_correct.PATCH_NAMES}}
        )
        from {BUILD_TOKENIZER_MODULE} import build_tokenizer
        tokenizer = build_tokenizer(
            types.SimpleNamespace(tokenizer_type="NullTokenizer", vocab_size={N}, padded_vocab_size=128)
        )
        row = next(r for r in megatron_lora_patch.status() if r.patch == "null_tokenizer")
        print(
            tokenizer.vocab_size, tokenizer.eod, tokenizer.unique_identifiers["eod_id"], row.state, row.detail, sep="|"
        )
    """)
    result = run_python(sys.executable, code, plugins=False, args=("-W", "ignore"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"{N}|{N - 1}|{N - 1}|applied|not imported yet: {patch.TRAINING_MODULE}"
