"""`null_tokenizer` (opt-in): `--vocab-size N` counts the end-of-document token (docs/architecture.md section 6).

Megatron-Core's `NullTokenizer` up to 0.16 and Megatron-LM's training-side `_NullTokenizer`
read `--vocab-size N` as N ordinary ids plus EOD (`eod == N`, `vocab_size == N + 1`);
Megatron-LM main (#4057) and Megatron-Bridge count EOD inside (`eod == N - 1`, `vocab_size == N`).
With this patch on, the installed classes follow the second convention
(the logic is `megatron_lora_patch.integrations.null_tokenizer`):
- `__init__` of each null tokenizer builds the original for N - 1 ordinary ids;
- dataset cache keys (`unique_identifiers` of the core `NullTokenizer`, its
  `MegatronTokenizerText` wrapper and the training-side `_NullTokenizer`) add the EOD id, so
  the two conventions never reuse each other's cached indices and mock data.
A class already counting EOD inside skips the patch ("already upstream"); one following
neither convention makes it fail. Limitations: one state per patch (one upstream class skips
all); after a revert a tokenizer built while on keeps eod N-1 but its core key is unpatched.
"""

from __future__ import annotations

from megatron_lora_patch.integrations import null_tokenizer as null_tokenizer_eod
from megatron_lora_patch.integrations.null_tokenizer import CORE_MODULE, CORE_WRAPPER_MODULE, TRAINING_MODULE
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="null_tokenizer",
    summary="--vocab-size N includes the end-of-document token (eod = N-1, vocab_size = N) for every "
    "null tokenizer; dataset cache keys carry the EOD id; skipped where Megatron already does so",
    hooks={
        CORE_MODULE: null_tokenizer_eod.patch_core,
        CORE_WRAPPER_MODULE: null_tokenizer_eod.patch_core_wrapper,
        TRAINING_MODULE: null_tokenizer_eod.patch_training,
    },
    versions=tested_range(),
    default=False,
)
