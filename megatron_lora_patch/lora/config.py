"""LoRA configuration: a dataclass for code, `from_env()` for the zero-change launch.

Precedence (docs/architecture.md section 3): an explicit `LoraConfig` given to `set_active()`
beats the environment, which beats the defaults. Within the environment, the single
variables (`MEGATRON_LORA_RANK`, ...) beat the file named by `MEGATRON_LORA_CONFIG`
(TOML or JSON, keys are the dataclass field names).

`sp_input` decides what a column-parallel adapter keeps for its A-gradient under
sequence parallelism: "keep" (default) saves the sequence-gathered input the base layer
already gathered, so LoRA adds no collective at all (the same count as the frozen base;
costs one gathered activation per adapted column layer); "regather" saves only the
local shard and all-gathers it again in backward (the trade Megatron makes for its
trainable weights: one extra all-gather, less activation memory).

Fail closed (docs: fail-closed): the `lora_correct` plugin parses every `MEGATRON_LORA_*`
LoRA variable once, when it activates (`configure_from_env`, called from the plugin's
`megatron_lora_patch_configure`), whether or not the `lora_linear` patch is enabled: a
value the user set is a mistake either way. A bad value is a `LoraConfigError` (a
`UsageError`: one line naming the variable, the value and what is accepted). The parsed
configuration is cached, so the model build uses exactly what was validated. An empty
(or blank) variable means unset, as for the runtime's flags.

Per-module rank and alpha (PEFT's `rank_pattern` / `alpha_pattern`): `MEGATRON_LORA_RANK_PATTERN=
'linear_fc1=8,linear_fc2=8'` (a TOML / JSON table in the config file) maps a pattern, matched
like a target entry (a module's last name component, or an fnmatch glob over its canonical
qualified name), to that module's rank (alpha); the first matching entry wins, as in PEFT, and
a module no entry matches uses `rank` (`alpha`). `MEGATRON_LORA_RSLORA=1` scales by
alpha / sqrt(r) instead of alpha / r (rsLoRA, PEFT's `use_rslora`).
`MEGATRON_LORA_SEPARATE_PROJECTIONS=1` gives q, k, v (and SwiGLU gate, up) their own A and B, as
standard PEFT LoRA on separate projections (lora/adapters/projections.py).

Modules to train fully (PEFT's `modules_to_save`): `MEGATRON_LORA_MODULES_TO_SAVE='output_layer'`
names modules, matched like a target entry, whose base weights stay trainable with Megatron's own
sharding and grad sync (`trained_fully.py` says which modules qualify; tied embeddings are one weight).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import math
import os
from typing import Any, Callable, Mapping, Optional

from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.flags import ACCEPTED_BOOLEANS, parse_bool

ENV_PREFIX = "MEGATRON_LORA_"
CONFIG_FILE_VARIABLE = ENV_PREFIX + "CONFIG"
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
INIT_CHOICES = ("kaiming", "gaussian")
B_INIT_CHOICES = ("zero", "nonzero")
SP_INPUT_CHOICES = ("keep", "regather")
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")
#: Canonical names of the modules that may train fully (`modules_to_save`; lora/layers/trained_fully.py says why).
TRAINABLE_MODULES = ("output_layer", "embedding.word_embeddings")


class LoraConfigError(UsageError, ValueError):
    """A configuration value is invalid; the message is one line naming where it came from.
    (Still a ValueError, as before, for callers that catch that.)"""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # A target or exclude entry matches a module whose last name component equals it,
    # or whose canonical qualified name matches it as an fnmatch glob.
    targets: tuple = DEFAULT_TARGETS
    exclude: tuple = ()
    init: str = "kaiming"  # A: Kaiming-uniform (a=sqrt(5)) or Gaussian(0, 1/r), on the full fan-in
    b_init: str = "zero"  # "nonzero" draws B like A (tests need a non-zero delta)
    seed: int = 0
    sp_input: str = "keep"
    rslora: bool = False  # scale alpha / sqrt(r) (PEFT use_rslora) instead of alpha / r
    # ((pattern, value), ...): the first entry matching a module (like a target) sets its rank / alpha
    rank_pattern: tuple = ()
    alpha_pattern: tuple = ()
    # separate A and B per q / k / v and per gate / up on Megatron's fused linear_qkv / SwiGLU linear_fc1
    # (standard PEFT LoRA on separate projections; lora/adapters/projections.py); False: one A per fused layer
    separate_projections: bool = False
    # modules whose base weights train fully (PEFT modules_to_save), matched like targets
    modules_to_save: tuple = ()

    def __post_init__(self) -> None:
        for name in PATTERN_FIELDS:  # a mapping, or JSON's list of pairs, as a tuple of pairs in order
            object.__setattr__(self, name, _as_pairs(name, getattr(self, name)))
        for field in dataclasses.fields(self):
            _check(field.name, getattr(self, field.name), f"LoraConfig.{field.name}")

    @property
    def scale(self) -> float:
        """The LoRA scaling of a module no pattern matches: alpha / r (alpha / sqrt(r) for rsLoRA)."""
        return _scaling(self.alpha, self.rank, self.rslora)

    def rank_for(self, module: str) -> int:
        """The rank of the adapter of `module` (canonical name): the first matching rank_pattern entry, else `rank`."""
        return _first_match(self.rank_pattern, module, self.rank)

    def alpha_for(self, module: str) -> float:
        """The alpha of the adapter of `module`: the first matching alpha_pattern entry, else `alpha`."""
        return _first_match(self.alpha_pattern, module, self.alpha)

    def scale_for(self, module: str) -> float:
        """The scaling of the adapter of `module` (its own rank and alpha)."""
        return _scaling(self.alpha_for(module), self.rank_for(module), self.rslora)

    def description(self) -> dict:
        """The fields an exporter needs, as plain JSON data (`from_description` reads them back)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "rslora": self.rslora,
            "rank_pattern": [list(pair) for pair in self.rank_pattern],
            "alpha_pattern": [list(pair) for pair in self.alpha_pattern],
            "separate_projections": self.separate_projections,
            "modules_to_save": list(self.modules_to_save),
        }

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> "LoraConfig":
        """The rank / alpha settings, layout and fully trained modules of a checkpoint description (older
        ones have no rsLoRA, patterns, separate projections or modules to save)."""
        keys = ("rank", "alpha", "rslora", "rank_pattern", "alpha_pattern", "separate_projections")
        values = {key: description[key] for key in keys if key in description}
        return cls(**values, modules_to_save=tuple(description.get("modules_to_save", ())))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "LoraConfig":
        """Defaults, then the `MEGATRON_LORA_CONFIG` file, then single variables."""
        return _parse_environment(os.environ if environ is None else environ)[0]


def _parse_environment(environ: Mapping[str, str]) -> "tuple[LoraConfig, dict]":
    """The configuration and, per field, the label naming where its value came from."""
    values: dict = {}
    labels = {name: ENV_PREFIX + name.upper() for name in _RULES}
    path = environ.get(CONFIG_FILE_VARIABLE, "").strip()
    if path:
        values.update(_read_config_file(path))
        labels.update({name: f"{name} in {path}" for name in values})
    for name in _RULES:
        variable = ENV_PREFIX + name.upper()
        raw = environ.get(variable, "")
        if raw.strip():  # empty or blank means unset
            values[name] = _parse(name, raw, variable)
            labels[name] = variable
    return LoraConfig(**values), labels


def env_variables() -> tuple:
    """Every environment variable `from_env` reads."""
    return (CONFIG_FILE_VARIABLE,) + tuple(ENV_PREFIX + name.upper() for name in _RULES)


_active: Optional[LoraConfig] = None
_from_environment: Optional["tuple[LoraConfig, dict]"] = None  # parsed at plugin activation


def set_active(config: Optional[LoraConfig]) -> None:
    """Use `config` for the adapters attached from now on (None: back to the environment)."""
    global _active
    _active = config


def configure_from_env(environ: Optional[Mapping[str, str]] = None) -> LoraConfig:
    """Parse every LoRA variable now (at plugin activation) and keep the result for the model build."""
    global _from_environment
    _from_environment = None  # a failed parse leaves no stale configuration behind
    _from_environment = _parse_environment(os.environ if environ is None else environ)
    return _from_environment[0]


def active() -> LoraConfig:
    """The configuration in force: the one given to `set_active`, else the one parsed at
    activation, else (no plugin activation in this process) the environment now."""
    return active_with_labels()[0]


def active_with_labels() -> "tuple[LoraConfig, dict]":
    """`active()` and, per field, what the user sets to change it (for error messages):
    a variable, a key of the config file, or `LoraConfig.<field>` for a configuration from code."""
    if _active is not None:
        return _active, code_labels()
    if _from_environment is not None:
        return _from_environment
    return _parse_environment(os.environ)


def code_labels() -> dict:
    return {name: f"LoraConfig.{name}" for name in _RULES}


def module_matches(name: str, patterns: Any) -> bool:
    """A target / exclude / pattern entry matches a module whose last name component equals it,
    or whose canonical qualified name matches it as an fnmatch glob."""
    short = name.rsplit(".", 1)[-1]
    return any(pattern == short or fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _as_pairs(name: str, value: Any) -> Any:
    """A mapping or a sequence of 2-item sequences as a tuple of (pattern, value) pairs, alphas
    as floats; anything else is returned as is, for the field's check to refuse."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
        return value
    as_float = name == "alpha_pattern"
    return tuple((key, float(number) if as_float and _number(number) else number) for key, number in items)


def _first_match(pattern: tuple, module: str, default: Any) -> Any:
    return next((value for key, value in pattern if module_matches(module, (key,))), default)


def _scaling(alpha: float, rank: int, rslora: bool) -> float:
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
_RULES: dict = {
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
    "modules_to_save": (
        "a comma-separated list of modules to train fully, each matching one of " + ", ".join(TRAINABLE_MODULES)
        + " (a last name such as output_layer or word_embeddings, or a glob)",
        _OPTIONAL_NAMES[1],
        lambda v: _names(v, allow_empty=True)
        and all(any(module_matches(name, (entry,)) for name in TRAINABLE_MODULES) for entry in v),
    ),
}


def _fail(name: str, raw: Any, label: str) -> LoraConfigError:
    return LoraConfigError(f"{label} must be {_RULES[name][0]}, got {raw!r}")


def _check(name: str, value: Any, label: str) -> None:
    if not _RULES[name][2](value):
        raise _fail(name, value, label)


def _parse(name: str, raw: str, label: str) -> Any:
    """Turn the text `raw` into the typed value of field `name`, or fail naming `label`."""
    parser: Callable[[str], Any] = _RULES[name][1]
    try:
        value = parser(raw)
    except ValueError:
        raise _fail(name, raw, label) from None
    if not _RULES[name][2](value):
        raise _fail(name, raw, label)  # report the text as given, not the parsed value
    return value


def _read_config_file(path: str) -> dict:
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
        if key not in _RULES:
            close = difflib.get_close_matches(str(key), list(_RULES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise LoraConfigError(f"{where}: unknown key {key!r}{hint}; accepted keys: {', '.join(_RULES)}")
        label = f"{key} in {path}"
        if isinstance(value, str):
            values[key] = _parse(key, value, label)
        else:
            typed = tuple(value) if isinstance(value, list) else value
            typed = _as_pairs(key, value) if key in PATTERN_FIELDS else typed
            typed = float(typed) if key in ("alpha", "dropout") and _number(typed) else typed
            if not _RULES[key][2](typed):
                raise _fail(key, value, label)  # the value as written in the file
            values[key] = typed
    return values


def _load_toml(raw: bytes) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no TOML reader in the standard library
        raise LoraConfigError(f"{CONFIG_FILE_VARIABLE}: TOML needs Python 3.11+; use a .json file") from None
    return tomllib.loads(raw.decode("utf-8"))
