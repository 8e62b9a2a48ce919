"""`null_tokenizer` (opt-in): `--vocab-size N` counts the end-of-document token (docs/architecture.md section 6).

Megatron-Core's `NullTokenizer` up to 0.16 and Megatron-LM's training-side `_NullTokenizer`
read `--vocab-size N` as N ordinary ids plus EOD (`eod == N`, `vocab_size == N + 1`);
Megatron-LM main (#4057) and Megatron-Bridge count EOD inside (`eod == N - 1`, `vocab_size == N`).
With this patch on, the installed classes follow the second convention:
- `__init__` of each null tokenizer builds the original for N - 1 ordinary ids;
- dataset cache keys (`unique_identifiers` of the core `NullTokenizer`, its
  `MegatronTokenizerText` wrapper and the training-side `_NullTokenizer`) add the EOD id, so
  the two conventions never reuse each other's cached indices and mock data.
Each hook first probes its class (built for a small N with logging muted): a class already
counting EOD inside skips the patch ("already upstream"); one following neither convention makes
it fail instead of a guess. Limitations: one state per patch (one upstream class skips
all); after a revert a tokenizer built while on keeps eod N-1 but its core key is unpatched.
"""

from __future__ import annotations

import json
import logging
import types
from typing import Any, Callable, Optional

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import Patcher, PatchSpec, inspect_static
from megatron_lora_patch.runtime.registry import SkipPatch

CORE_MODULE = "megatron.core.tokenizers.text.libraries.null_tokenizer"
CORE_WRAPPER_MODULE = "megatron.core.tokenizers.text.text_tokenizer"
TRAINING_MODULE = "megatron.training.tokenizer.tokenizer"

#: The wrapper's `library` for the null tokenizer: "null" up to 0.16, "null-text" from 0.17.
NULL_LIBRARIES = ("null", "null-text")
#: Size the hooks build each class with to find out which convention it follows.
PROBE_SIZE = 8


# -- convention check -------------------------------------------------------------------------


def _probe(tokenizer_class: type) -> tuple[int, int]:
    """(vocab_size, eod) of `tokenizer_class(PROBE_SIZE)`, built with logging muted: the probe
    is ours, so the legacy base class's deprecation warning would only be noise."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        probe = tokenizer_class(PROBE_SIZE)
        return int(probe.vocab_size), int(probe.eod)
    finally:
        logging.disable(previous)


def require_eod_outside_vocab(tokenizer_class: type, where: str) -> None:
    """Return if `tokenizer_class` follows the old convention (the one this patch changes);
    raise SkipPatch if it already counts EOD inside, an error if it follows neither."""
    vocab_size, eod = _probe(tokenizer_class)
    observed = f"{where}({PROBE_SIZE}) has vocab_size {vocab_size} and eod {eod}"
    if (vocab_size, eod) == (PROBE_SIZE, PROBE_SIZE - 1):
        raise SkipPatch(f"already upstream: {observed}")
    if (vocab_size, eod) != (PROBE_SIZE + 1, PROBE_SIZE):
        raise RuntimeError(
            f"{observed}, which is neither vocab_size N+1 / eod N nor vocab_size N / eod N-1; "
            "the null_tokenizer patch does not know this class. Fix: disable the patch "
            "(MEGATRON_LORA_PATCH_NULL_TOKENIZER=0)"
        )


# -- constructors -----------------------------------------------------------------------------


def _vocab_size_argument(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Split the `vocab_size` argument (first positional or keyword) from the others."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("vocab_size", None), args, rest


def _construct_counting_eod(wrapped: Callable, args: tuple, kwargs: dict) -> Optional[int]:
    """Build the original tokenizer for N - 1 ordinary ids; returns N (None: no size given)."""
    size, args, kwargs = _vocab_size_argument(args, kwargs)
    if size is None:
        wrapped(*args, **kwargs)  # the original reports the missing argument itself
        return None
    size = int(size)
    if size < 1:
        raise ValueError(
            f"null_tokenizer patch: --vocab-size counts the end-of-document token, so it must be at least 1; got {size}"
        )
    wrapped(size - 1, *args, **kwargs)
    return size


def _core_init(wrapped, instance, args, kwargs):
    _construct_counting_eod(wrapped, args, kwargs)


def _training_init(wrapped, instance, args, kwargs):
    size = _construct_counting_eod(wrapped, args, kwargs)
    if size is None:
        return
    # The legacy base class stores the key at construction (from the N - 1 it was given):
    # record the user's N and the EOD id, which tells the two conventions apart.
    identifiers = instance.unique_identifiers
    identifiers["vocab_size"] = str(size)
    identifiers["eod_id"] = str(instance.eod)
    if hasattr(instance, "unique_description"):
        instance.unique_description = json.dumps(identifiers, indent=4)


# -- cache keys of the core classes -----------------------------------------------------------


def _identifiers_with(original: property, extra: Callable[[Any], dict]) -> property:
    """`original` unique_identifiers property plus the entries `extra(self)` returns."""

    def unique_identifiers(self):
        identifiers = original.__get__(self, type(self))
        identifiers.update(extra(self))
        return identifiers

    unique_identifiers.__doc__ = (original.__doc__ or "") + " (null_tokenizer patch: with the EOD id)"
    return property(unique_identifiers)


def patch_core(patcher: Patcher, module: types.ModuleType) -> None:
    """Core `NullTokenizer`: N counts EOD; its cache key adds vocab_size and the EOD id."""
    null_tokenizer = module.NullTokenizer
    require_eod_outside_vocab(null_tokenizer, f"{module.__name__}.NullTokenizer")
    patcher.wrap(null_tokenizer, "__init__", _core_init)
    patcher.replace(
        null_tokenizer,
        "unique_identifiers",
        _identifiers_with(
            inspect_static(null_tokenizer, "unique_identifiers"),
            lambda tokenizer: {"vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod},
        ),
    )


def patch_core_wrapper(patcher: Patcher, module: types.ModuleType) -> None:
    """The wrapper keys on its constructor arguments only (`vocab_size` = N in both conventions).

    A hook of its own: this module imports the tokenizer libraries, so the core hook runs
    while it is still half initialized."""
    wrapper = module.MegatronTokenizerText

    def null_library_eod(text_tokenizer) -> dict:
        return {"eod_id": str(text_tokenizer.eod)} if getattr(text_tokenizer, "library", None) in NULL_LIBRARIES else {}

    patcher.replace(
        wrapper,
        "unique_identifiers",
        _identifiers_with(inspect_static(wrapper, "unique_identifiers"), null_library_eod),
    )


def patch_training(patcher: Patcher, module: types.ModuleType) -> None:
    """Megatron-LM's `_NullTokenizer`: N counts EOD; its stored cache key records N and the EOD id."""
    null_tokenizer = module._NullTokenizer
    require_eod_outside_vocab(null_tokenizer, f"{module.__name__}._NullTokenizer")
    patcher.wrap(null_tokenizer, "__init__", _training_init)


SPEC = PatchSpec(
    name="null_tokenizer",
    summary="--vocab-size N includes the end-of-document token (eod = N-1, vocab_size = N) for every "
    "null tokenizer; dataset cache keys carry the EOD id; skipped where Megatron already does so",
    hooks={
        CORE_MODULE: patch_core,
        CORE_WRAPPER_MODULE: patch_core_wrapper,
        TRAINING_MODULE: patch_training,
    },
    versions=tested_range(),
    default=False,
)
