"""LoRA configuration: a dataclass for code, `from_env()` for the zero-change launch.

Precedence (DESIGN.md section 3): an explicit `LoraConfig` given to `set_active()`
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
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any, Callable, Mapping, Optional

from megatron_lora_patch.errors import UsageError

ENV_PREFIX = "MEGATRON_LORA_"
CONFIG_FILE_VARIABLE = ENV_PREFIX + "CONFIG"
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
INIT_CHOICES = ("kaiming", "gaussian")
B_INIT_CHOICES = ("zero", "nonzero")
SP_INPUT_CHOICES = ("keep", "regather")


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

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check(field.name, getattr(self, field.name), f"LoraConfig.{field.name}")

    @property
    def scale(self) -> float:
        """The LoRA scaling s = alpha / r."""
        return self.alpha / self.rank

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


def _names(value: Any, allow_empty: bool) -> bool:
    return (
        isinstance(value, tuple)
        and (allow_empty or len(value) > 0)
        and all(isinstance(name, str) and name.strip() and "," not in name for name in value)
    )


# field -> (requirement sentence, string parser, typed-value check)
_RULES: dict = {
    "rank": ("a positive integer", int, _positive_int),
    "alpha": ("a positive finite number", float, lambda v: _number(v) and 0 < v < math.inf),
    "dropout": ("a number in [0, 1)", float, lambda v: _number(v) and 0 <= v < 1),
    "targets": (
        "a non-empty comma-separated list of module names or glob patterns",
        _split_names,
        lambda v: _names(v, allow_empty=False),
    ),
    "exclude": (
        "a comma-separated list of module names or glob patterns",
        lambda text: _split_names(text) if text.strip() else (),
        lambda v: _names(v, allow_empty=True),
    ),
    "init": ("one of " + ", ".join(INIT_CHOICES), str.strip, lambda v: v in INIT_CHOICES),
    "b_init": ("one of " + ", ".join(B_INIT_CHOICES), str.strip, lambda v: v in B_INIT_CHOICES),
    "seed": ("a non-negative integer", int, _non_negative_int),
    "sp_input": ("one of " + ", ".join(SP_INPUT_CHOICES), str.strip, lambda v: v in SP_INPUT_CHOICES),
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
