"""The rules of every LoRA setting (docs/architecture.md section 3): what each field accepts and how its
text is parsed, the module-name matching targets and patterns use, and reading the `MEGATRON_LORA_CONFIG`
file (TOML or JSON). Every refusal is a one-line `LoraConfigError` naming the variable or key, the value
and what is accepted (docs/fail-closed.md)."""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
from typing import Any, Callable, Mapping, Sequence

from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.flags import ACCEPTED_BOOLEANS, parse_bool

ENV_PREFIX = "MEGATRON_LORA_"
CONFIG_FILE_VARIABLE = ENV_PREFIX + "CONFIG"
#: GQA attention and MLP linears, and multi-latent attention's (DeepSeek-V2 / V3: PEFT's q_proj or q_a_proj /
#: q_b_proj, kv_a_proj_with_mqa, kv_b_proj; o_proj is `linear_proj`); a model has only some of them.
DEFAULT_TARGETS = (
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
    "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
)
INIT_CHOICES = ("kaiming", "gaussian")
B_INIT_CHOICES = ("zero", "nonzero")
SP_INPUT_CHOICES = ("keep", "regather")
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")
NAME_FIELDS = ("targets", "exclude", "modules_to_save")  # lists of module names
BOOLEAN_FIELDS = ("rslora", "separate_projections", "expert_shared_outer", "dora")
FLOAT_FIELDS = ("alpha", "dropout", "plus_ratio")  # a file's integer (4) means the number (4.0)
#: Canonical names of the modules that may train fully (`modules_to_save`; lora/layers/trained_fully.py says why).
TRAINABLE_MODULES = ("output_layer", "embedding.word_embeddings")


class LoraConfigError(UsageError, ValueError):
    """A configuration value is invalid; the message is one line naming where it came from.
    (Still a ValueError, as before, for callers that catch that.)"""


def module_matches(name: str, patterns: Any) -> bool:
    """A target / exclude / pattern entry matches a module whose last name component equals it,
    or whose canonical qualified name matches it as an fnmatch glob."""
    short = name.rsplit(".", 1)[-1]
    return any(pattern == short or fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def as_pairs(name: str, value: Any) -> Any:
    """A mapping or a sequence of 2-item sequences as a tuple of (pattern, value) pairs, alphas
    as floats; anything else is returned as is, for the field's check to refuse."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
        return value
    as_float = name == "alpha_pattern"
    return tuple((key, float(number) if as_float and _number(number) else number) for key, number in items)


def as_names(name: str, value: Any, label: str) -> Any:
    """Module names given as text (the variable's comma-separated form) or as any sequence of strings (a list
    in code, TOML or JSON), as a tuple; anything else is returned as is, for the field's check to refuse."""
    if isinstance(value, str):
        return parse(name, value, label)
    return tuple(value) if isinstance(value, Sequence) else value


def first_match(pattern: tuple, module: str, default: Any) -> Any:
    return next((value for key, value in pattern if module_matches(module, (key,))), default)


def scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _split_names(text: str) -> tuple:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ValueError(text)
    return names


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pattern_parser(value_type: Callable[[str], Any]) -> Callable[[str], tuple]:
    """'pattern=value,pattern=value' -> ((pattern, value), ...)."""

    def parse(text: str) -> tuple:
        pairs = []
        for entry in _split_names(text):
            key, equals, value = entry.partition("=")
            if not equals or not key.strip():
                raise ValueError(text)
            pairs.append((key.strip(), value_type(value.strip())))
        return tuple(pairs)

    return parse


def _pattern(value: Any, check_value: Callable[[Any], bool]) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(pair, tuple) and len(pair) == 2 and _names((pair[0],), allow_empty=False)
        and "=" not in pair[0] and check_value(pair[1])
        for pair in value
    ) and len({pair[0] for pair in value}) == len(value)


def _positive_finite(value: Any) -> bool:
    return _number(value) and 0 < value < math.inf


def _names(value: Any, allow_empty: bool) -> bool:
    return (
        isinstance(value, tuple)
        and (allow_empty or len(value) > 0)
        and all(isinstance(name, str) and name.strip() and "," not in name for name in value)
    )


_OPTIONAL_NAMES = (
    "a comma-separated list of module names or glob patterns",
    lambda text: _split_names(text) if text.strip() else (),
    lambda v: _names(v, allow_empty=True),
)

# field -> (requirement sentence, string parser, typed-value check)
RULES: dict = {
    "rank": ("a positive integer", int, _positive_int),
    "alpha": ("a positive finite number", float, _positive_finite),
    "dropout": ("a number in [0, 1)", float, lambda v: _number(v) and 0 <= v < 1),
    "targets": (
        "a non-empty comma-separated list of module names or glob patterns",
        _split_names,
        lambda v: _names(v, allow_empty=False),
    ),
    "exclude": _OPTIONAL_NAMES,
    "init": ("one of " + ", ".join(INIT_CHOICES), str.strip, lambda v: v in INIT_CHOICES),
    "b_init": ("one of " + ", ".join(B_INIT_CHOICES), str.strip, lambda v: v in B_INIT_CHOICES),
    "seed": ("a non-negative integer", int, _non_negative_int),
    "sp_input": ("one of " + ", ".join(SP_INPUT_CHOICES), str.strip, lambda v: v in SP_INPUT_CHOICES),
    "rslora": ("one of " + ACCEPTED_BOOLEANS, lambda text: parse_bool("rslora", text), lambda v: isinstance(v, bool)),
    "rank_pattern": (
        "comma-separated pattern=rank entries (positive integer ranks, each pattern once), "
        "e.g. 'linear_fc1=8,linear_fc2=8'",
        _pattern_parser(int),
        lambda v: _pattern(v, _positive_int),
    ),
    "alpha_pattern": (
        "comma-separated pattern=alpha entries (positive numbers, each pattern once), e.g. 'linear_fc1=16'",
        _pattern_parser(float),
        lambda v: _pattern(v, _positive_finite),
    ),
    "separate_projections": (
        "one of " + ACCEPTED_BOOLEANS,
        lambda text: parse_bool("separate_projections", text),
        lambda v: isinstance(v, bool),
    ),
    "expert_shared_outer": (
        "one of " + ACCEPTED_BOOLEANS,
        lambda text: parse_bool("expert_shared_outer", text),
        lambda v: isinstance(v, bool),
    ),
    "modules_to_save": (
        "a comma-separated list of modules to train fully, each matching one of " + ", ".join(TRAINABLE_MODULES)
        + " (a last name such as output_layer or word_embeddings, or a glob)",
        _OPTIONAL_NAMES[1],
        lambda v: _names(v, allow_empty=True)
        and all(any(module_matches(name, (entry,)) for name in TRAINABLE_MODULES) for entry in v),
    ),
    "plus_ratio": ("a positive finite number (B's learning rate / A's; 1: plain LoRA)", float, _positive_finite),
    "dora": ("one of " + ACCEPTED_BOOLEANS, lambda text: parse_bool("dora", text), lambda v: isinstance(v, bool)),
}


def _fail(name: str, raw: Any, label: str) -> LoraConfigError:
    """The refusal of `raw` for field `name`: what it accepts as text, or (a boolean given as a typed value, in
    code or a TOML / JSON file, where 1 and "1" differ) true or false."""
    requirement = "true or false" if name in BOOLEAN_FIELDS and not isinstance(raw, str) else RULES[name][0]
    return LoraConfigError(f"{label} must be {requirement}, got {raw!r}")


def check(name: str, value: Any, label: str) -> None:
    if not RULES[name][2](value):
        raise _fail(name, value, label)


def parse(name: str, raw: str, label: str) -> Any:
    """Turn the text `raw` into the typed value of field `name`, or fail naming `label`."""
    parser: Callable[[str], Any] = RULES[name][1]
    try:
        value = parser(raw)
    except ValueError:
        raise _fail(name, raw, label) from None
    if not RULES[name][2](value):
        raise _fail(name, raw, label)  # report the text as given, not the parsed value
    return value


def read_config_file(path: str) -> dict:
    where = f"{CONFIG_FILE_VARIABLE} ({path})"
    if not path.endswith((".toml", ".json")):
        raise LoraConfigError(f"{CONFIG_FILE_VARIABLE} must name a .toml or .json file, got {path!r}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise LoraConfigError(f"{where}: cannot read the file: {error.strerror}") from None
    try:
        data = _load_toml(raw) if path.endswith(".toml") else json.loads(raw)
    except ValueError as error:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise LoraConfigError(f"{where}: invalid {kind}: {error}") from None
    if not isinstance(data, dict):
        raise LoraConfigError(f"{where}: the top level must be a table of settings, got {type(data).__name__}")
    values = {}
    for key, value in data.items():
        if key not in RULES:
            close = difflib.get_close_matches(str(key), list(RULES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LoraConfigError(f"{where}: unknown key {key!r}{hint}; accepted keys: {', '.join(RULES)}")
        label = f"{key} in {path}"
        if isinstance(value, str):
            values[key] = parse(key, value, label)
        else:
            typed = tuple(value) if isinstance(value, list) else value
            typed = as_pairs(key, value) if key in PATTERN_FIELDS else typed
            typed = float(typed) if key in FLOAT_FIELDS and _number(typed) else typed
            if not RULES[key][2](typed):
                raise _fail(key, value, label)  # the value as written in the file
            values[key] = typed
    return values


def _load_toml(raw: bytes) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no TOML reader in the standard library
        raise LoraConfigError(f"{CONFIG_FILE_VARIABLE}: TOML needs Python 3.11+; use a .json file") from None
    return tomllib.loads(raw.decode("utf-8"))
