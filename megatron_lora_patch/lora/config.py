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
`MEGATRON_LORA_EXPERT_SHARED_OUTER=1` gives each MoE layer's routed experts one shared fc1 A and one shared
fc2 B (SGLang's shared-outer layout; lora/layers/shared_outer.py, docs/handoff.md section 4).
`MEGATRON_LORA_PLUS_RATIO=16` (LoRA+, PEFT's `loraplus_lr_ratio`) trains every B at 16 times A's learning
rate (the `lora_plus` patch, lora/training/lora_plus.py).
`MEGATRON_LORA_DORA=1` (DoRA, PEFT's `use_dora`) adds a trained magnitude per adapted output row
(lora/adapters/dora.py).

Modules to train fully (PEFT's `modules_to_save`): `MEGATRON_LORA_MODULES_TO_SAVE='output_layer'`
names modules, matched like a target entry, whose base weights stay trainable with Megatron's own
sharding and grad sync (`trained_fully.py` says which modules qualify; tied embeddings are one weight).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from megatron_lora_patch.lora.config_rules import (
    B_INIT_CHOICES,
    CONFIG_FILE_VARIABLE,
    DEFAULT_TARGETS,
    ENV_PREFIX,
    INIT_CHOICES,
    NAME_FIELDS,
    PATTERN_FIELDS,
    RULES,
    SP_INPUT_CHOICES,
    TRAINABLE_MODULES,
    LoraConfigError,
    as_names,
    as_pairs,
    check,
    first_match,
    module_matches,
    parse,
    read_config_file,
    scaling,
)

__all__ = [  # the rules' names users of the configuration reach through this module
    "B_INIT_CHOICES", "DEFAULT_TARGETS", "INIT_CHOICES", "PATTERN_FIELDS", "SP_INPUT_CHOICES", "TRAINABLE_MODULES",
    "LoraConfig", "LoraConfigError", "module_matches",
]

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
    # one fc1 (gate_up) A and one fc2 (down) B per MoE layer, shared by all its routed experts (SGLang's
    # --experts-shared-outer-loras layout; lora/layers/shared_outer.py); False: every expert has its own
    expert_shared_outer: bool = False
    # modules whose base weights train fully (PEFT modules_to_save), matched like targets
    modules_to_save: tuple = ()
    # LoRA+ (PEFT's loraplus_lr_ratio): every B learns at this multiple of A's learning rate (max_lr and min_lr
    # alike, through Megatron's optimizer param-group overrides; lora/training/lora_plus.py); 1: plain LoRA
    plus_ratio: float = 1.0
    # DoRA (PEFT's use_dora): each adapted output row is rescaled by a trained magnitude over the detached norm of
    # its merged weight row (lora/adapters/dora.py); False: plain LoRA
    dora: bool = False

    def __post_init__(self) -> None:
        for name in PATTERN_FIELDS:  # a mapping, or JSON's list of pairs, as a tuple of pairs in order
            object.__setattr__(self, name, as_pairs(name, getattr(self, name)))
        for name in NAME_FIELDS:  # any sequence of names (a list, a tuple), or the variable's comma-separated text
            object.__setattr__(self, name, as_names(name, getattr(self, name), f"LoraConfig.{name}"))
        for field in dataclasses.fields(self):
            check(field.name, getattr(self, field.name), f"LoraConfig.{field.name}")

    @property
    def scale(self) -> float:
        """The LoRA scaling of a module no pattern matches: alpha / r (alpha / sqrt(r) for rsLoRA)."""
        return scaling(self.alpha, self.rank, self.rslora)

    def rank_for(self, module: str) -> int:
        """The rank of the adapter of `module` (canonical name): the first matching rank_pattern entry, else `rank`."""
        return first_match(self.rank_pattern, module, self.rank)

    def alpha_for(self, module: str) -> float:
        """The alpha of the adapter of `module`: the first matching alpha_pattern entry, else `alpha`."""
        return first_match(self.alpha_pattern, module, self.alpha)

    def scale_for(self, module: str) -> float:
        """The scaling of the adapter of `module` (its own rank and alpha)."""
        return scaling(self.alpha_for(module), self.rank_for(module), self.rslora)

    def description(self) -> dict:
        """The fields an exporter needs, as plain JSON data (`from_description` reads them back)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "rslora": self.rslora,
            "rank_pattern": [list(pair) for pair in self.rank_pattern],
            "alpha_pattern": [list(pair) for pair in self.alpha_pattern],
            "separate_projections": self.separate_projections,
            "expert_shared_outer": self.expert_shared_outer,
            "modules_to_save": list(self.modules_to_save),
            "dora": self.dora,
        }

    @classmethod
    def from_description(cls, description: Mapping[str, Any]) -> "LoraConfig":
        """The rank / alpha settings, layout and fully trained modules of a checkpoint description (older
        ones have no rsLoRA, patterns, separate projections, shared outer expert factors, modules to save or DoRA)."""
        keys = ("rank", "alpha", "rslora", "rank_pattern", "alpha_pattern", "separate_projections",
                "expert_shared_outer", "dora")
        values = {key: description[key] for key in keys if key in description}
        return cls(**values, modules_to_save=tuple(description.get("modules_to_save", ())))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "LoraConfig":
        """Defaults, then the `MEGATRON_LORA_CONFIG` file, then single variables."""
        return _parse_environment(os.environ if environ is None else environ)[0]


def _parse_environment(environ: Mapping[str, str]) -> "tuple[LoraConfig, dict]":
    """The configuration and, per field, the label naming where its value came from."""
    values: dict = {}
    labels = {name: ENV_PREFIX + name.upper() for name in RULES}
    path = environ.get(CONFIG_FILE_VARIABLE, "").strip()
    if path:
        values.update(read_config_file(path))
        labels.update({name: f"{name} in {path}" for name in values})
    for name in RULES:
        variable = ENV_PREFIX + name.upper()
        raw = environ.get(variable, "")
        if raw.strip():  # empty or blank means unset
            values[name] = parse(name, raw, variable)
            labels[name] = variable
    return LoraConfig(**values), labels


def env_variables() -> tuple:
    """Every environment variable `from_env` reads."""
    return (CONFIG_FILE_VARIABLE,) + tuple(ENV_PREFIX + name.upper() for name in RULES)


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
    return {name: f"LoraConfig.{name}" for name in RULES}
