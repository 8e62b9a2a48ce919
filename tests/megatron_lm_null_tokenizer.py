"""Test double of Megatron-LM's training-side `megatron/training/tokenizer/tokenizer.py::_NullTokenizer`.

Megatron-LM is not installed here (and main removed the legacy tokenizers in #2946), so the
tests rebuild the class from its documented behaviour, on the real `MegatronLegacyTokenizer`
base of the installed Megatron-Core:
- built as `_NullTokenizer(N)`, it passes no tokenizer path and the option `vocab_size=N` to the
  base, whose `unique_identifiers` is then {class name, tokenizer_path [None], vocab_size "N"};
- `vocab_size` is N + 1 and `eod` is N (EOD sits after the N ordinary ids);
- `tokenize` reads space-separated integers, `detokenize` writes them back, `offsets` gives
  each id's start in that text;
- `cls`, `sep`, `mask` are -1, `additional_special_tokens_ids` is None. Megatron-LM's `vocab` and
  `inv_vocab` raise NotImplementedError; here they are the mapping `tokenize` / `detokenize` apply
  (each id's decimal text <-> the id, EOD included), which no test depends on.
`install_training_module` makes one of the doubles importable as
`megatron.training.tokenizer.tokenizer._NullTokenizer` (megatron is a namespace package),
so the patch's real post-import hook runs on it. From Megatron-Core 0.17 the legacy base is gone
(`HAVE_LEGACY_BASE` False): the doubles then stand on a bare base, enough for the convention probe.
"""

from __future__ import annotations

import pathlib

try:
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
except ModuleNotFoundError:  # Megatron-Core 0.17 removed it, and Megatron-LM its training-side tokenizers

    class MegatronLegacyTokenizer:  # type: ignore[no-redef]
        """Stand-in base so the convention probe still has the two conventions to look at."""

        def __init__(self, *tokenizer_paths, **tokenizer_options):
            pass

    HAVE_LEGACY_BASE = False
else:
    HAVE_LEGACY_BASE = True


class _NullTokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's `_NullTokenizer` (same name, so the same cache key): `--vocab-size N` excludes EOD."""

    def __init__(self, vocab_size):
        super().__init__(None, vocab_size=vocab_size)
        self._ordinary_ids = int(vocab_size)

    def tokenize(self, text):
        return list(map(int, text.split(" ")))

    def detokenize(self, ids):
        return " ".join(map(str, ids))

    def offsets(self, ids, text):
        starts, position = [], 0
        for token in ids:
            starts.append(position)
            position += len(str(token)) + 1  # the id and the space after it
        return starts

    @property
    def vocab_size(self):
        return self._ordinary_ids + 1

    @property
    def eod(self):
        return self._ordinary_ids

    @property
    def vocab(self):
        return {str(token): token for token in range(self.vocab_size)}

    @property
    def inv_vocab(self):
        return {token: text for text, token in self.vocab.items()}

    @property
    def cls(self):
        return -1

    @property
    def sep(self):
        return -1

    @property
    def mask(self):
        return -1

    @property
    def additional_special_tokens_ids(self):
        return None


class EodInVocabNullTokenizer(_NullTokenizer):
    """A training-side class that already counts EOD inside `--vocab-size N` (the upstream
    convention of Megatron-LM main's core NullTokenizer): the patch must leave it alone."""

    @property
    def vocab_size(self):
        return self._ordinary_ids

    @property
    def eod(self):
        return self._ordinary_ids - 1


def install_training_module(root: pathlib.Path, class_name: str) -> pathlib.Path:
    """Write `megatron/training/tokenizer/tokenizer.py` under `root`, exporting `class_name` of
    this module as `_NullTokenizer`; put `root` on sys.path to make it importable."""
    package = root / "megatron" / "training" / "tokenizer"
    package.mkdir(parents=True)
    for directory in (package.parent, package):
        (directory / "__init__.py").write_text("")
    (package / "tokenizer.py").write_text(
        f'"""Test double of Megatron-LM\'s training tokenizers."""\n'
        f"from megatron_lm_null_tokenizer import {class_name} as _NullTokenizer\n"
    )
    return root
