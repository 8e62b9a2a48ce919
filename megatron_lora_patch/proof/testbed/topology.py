"""The parallel topology of a test world: a value type, its spec-string grammar, and Megatron setup.

Spec strings are dash-separated parts, each at most once, in any order:
``tpN`` (tensor), ``ppN`` (pipeline), ``cpN`` (context), ``dpN`` (data), ``epN`` (expert),
``etpN`` (expert tensor) parallel sizes, and the flag ``sp`` (sequence parallel).
Omitted sizes are 1, except ``dp``: when omitted it is the smallest data-parallel size
that makes room for the expert grid, ``lcm(tp*cp, ep*etp) / (tp*cp)`` (so ``ep2`` is a
2-rank world: dense layers data-parallel, experts expert-parallel, as Megatron carves EP
out of DP). ``etp`` defaults to 1, not to ``tp`` (Megatron's default): the spec says it.

World size is ``tp * pp * cp * dp``; the expert layers see the same ranks as
``etp * ep * expert_dp * pp`` (Megatron's ``parallel_state.initialize_model_parallel``).

Canonical string (``str(topology)``): parts in the order ``tp pp cp dp ep etp sp``, sizes
of 1 and the derived ``dp`` omitted; the one-rank world is ``"tp1"``. Examples:
``tp2-sp``, ``dp2``, ``pp2``, ``ep2``, ``tp2-ep2-etp2-sp``, ``tp2-dp2``, ``cp2``.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from megatron_lora_patch.runtime.errors import UsageError

__all__ = ["Topology", "TopologyError"]

_SIZE_PARTS = ("tp", "pp", "cp", "dp", "ep", "etp")
_PART_SYNTAX = "tpN, ppN, cpN, dpN, epN, etpN, sp"
_EXAMPLES = "'tp2-sp', 'dp2', 'pp2', 'ep2', 'tp2-ep2-etp2-sp', 'tp2-dp2', 'cp2', 'tp1'"
_PART = re.compile(r"^(etp|tp|pp|cp|dp|ep)(\d+)$")
DEFAULT_SEED = 1234


class TopologyError(UsageError, ValueError):
    """An invalid topology spec or combination; the message says what is wrong and what would be valid.

    ``reason`` is the message without its subject prefix.
    """

    def __init__(self, reason: str, subject: str = "invalid topology") -> None:
        super().__init__(f"{subject}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Topology:
    """Parallel sizes of one world. ``dp=None`` derives the smallest dp that fits the expert grid."""

    tp: int = 1
    pp: int = 1
    dp: int = None  # type: ignore[assignment]  # always an int after __post_init__
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        for name in _SIZE_PARTS:
            value = getattr(self, name)
            if name == "dp" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.sp and self.tp < 2:
            raise TopologyError(f"sp (sequence parallel) needs tp > 1, got tp{self.tp}; use e.g. 'tp2-sp' or drop 'sp'")
        dense_ranks = self.tp * self.cp
        expert_ranks = self.ep * self.etp
        minimal_dp = math.lcm(dense_ranks, expert_ranks) // dense_ranks
        if self.dp is None:
            object.__setattr__(self, "dp", minimal_dp)
        elif self.dp % minimal_dp:
            raise TopologyError(
                f"ep{self.ep} x etp{self.etp} = {expert_ranks} expert ranks must divide "
                f"tp*cp*dp = {dense_ranks * self.dp} (ranks per pipeline stage); "
                f"use dp{minimal_dp} (or a multiple), or omit dp to derive it"
            )

    @classmethod
    def parse(cls, spec: str) -> "Topology":
        """Parse a spec string such as ``"tp2-ep2-etp2-sp"``; raise :class:`TopologyError` if invalid."""
        if not isinstance(spec, str):
            raise TypeError(f"topology spec must be a string, got {type(spec).__name__}")

        def fail(reason: str) -> TopologyError:
            return TopologyError(reason, subject=f"invalid topology spec {spec!r}")

        usage = f"expected dash-separated parts ({_PART_SYNTAX}), e.g. {_EXAMPLES}"
        if not spec:
            raise fail(f"it is empty; {usage}")
        sizes: dict[str, int] = {}
        sp = False
        for part in spec.split("-"):
            match = _PART.match(part)
            name = match.group(1) if match else part
            if not part:
                raise fail(f"empty part (doubled, leading or trailing '-'); {usage}")
            if name in sizes or (name == "sp" and sp):
                raise fail(f"duplicate part {name!r}; give each part at most once")
            if part == "sp":
                sp = True
            elif match:
                sizes[name] = int(match.group(2))
                if sizes[name] < 1:
                    raise fail(f"size in {part!r} must be a positive integer, e.g. '{name}2'")
            elif part in _SIZE_PARTS:
                raise fail(f"part {part!r} needs a size, e.g. '{part}2'")
            elif re.fullmatch(r"sp\d+", part):
                raise fail(f"sequence parallel is a flag without a size: write 'sp', not {part!r}")
            else:
                raise fail(f"unknown part {part!r}; {usage}")
        try:
            return cls(**sizes, sp=sp)
        except TopologyError as error:
            raise fail(error.reason) from None

    def __str__(self) -> str:
        derived_dp = Topology(tp=self.tp, cp=self.cp, ep=self.ep, etp=self.etp).dp
        parts = [
            f"{name}{getattr(self, name)}"
            for name in ("tp", "pp", "cp", "dp", "ep", "etp")
            if getattr(self, name) != (derived_dp if name == "dp" else 1)
        ]
        if self.sp:
            parts.append("sp")
        return "-".join(parts) or "tp1"

    @property
    def world_size(self) -> int:
        """Number of ranks: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world_size / (etp * ep * pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def validate(
        self,
        *,
        num_experts: int | None = None,
        num_layers: int | None = None,
        seq_length: int | None = None,
        max_world: int | None = 8,
    ) -> "Topology":
        """Check this topology against a model and a machine; return self or raise one :class:`TopologyError`.

        ``num_experts``: None or 0 for a dense model. Checks (in this order): world size
        <= ``max_world``; ep/etp > 1 need a MoE model; experts divisible by ep; etp == tp
        when ep is 1 (Megatron's DDP syncs ep1 expert weights as dense ones); MoE with
        ep > 1 and tp > 1 needs sp (Megatron requires it); layers divisible by pp;
        sequence divisible by 2*cp when cp > 1 (load-balanced CP chunks) and by tp under sp.
        """
        problems = []
        if max_world is not None and self.world_size > max_world:
            problems.append(f"needs {self.world_size} ranks but at most {max_world} are allowed; use smaller sizes")
        if not num_experts and (self.ep > 1 or self.etp > 1):
            problems.append(
                f"ep{self.ep} and etp{self.etp} shard experts but the model has none (num_experts={num_experts}); "
                "drop ep/etp or use a MoE model"
            )
        if num_experts and num_experts % self.ep:
            problems.append(
                f"num_experts={num_experts} is not divisible by ep{self.ep}; use an ep dividing {num_experts}"
            )
        if self.ep == 1 and self.etp not in (1, self.tp):
            # Megatron marks expert weights allreduce=True when ep is 1, so DDP syncs them over
            # dense DP: with etp != tp that mixes different expert shards (broadcast and grads).
            problems.append(
                f"etp{self.etp} with ep1 needs etp == tp (Megatron DDP treats ep1 expert weights as dense); "
                f"use 'tp{self.etp}-etp{self.etp}-sp' or ep > 1"
            )
        if num_experts and self.ep > 1 and self.tp > 1 and not self.sp:
            problems.append("MoE with ep > 1 and tp > 1 needs sequence parallel (Megatron requires it); add 'sp'")
        if num_layers is not None and num_layers % self.pp:
            problems.append(f"num_layers={num_layers} is not divisible by pp{self.pp}; use a pp dividing {num_layers}")
        if seq_length is not None and self.cp > 1 and seq_length % (2 * self.cp):
            problems.append(
                f"seq_length={seq_length} is not divisible by 2*cp = {2 * self.cp} (load-balanced CP chunks)"
            )
        if seq_length is not None and self.sp and seq_length % self.tp:
            problems.append(f"seq_length={seq_length} is not divisible by tp{self.tp} (sequence parallel splits it)")
        if problems:
            raise TopologyError("; ".join(problems), subject=f"topology {str(self)!r} does not fit")
        return self

    # ------------------------------------------------------------------ Megatron setup (inside a rank)

    def initialize(self, *, seed: int | None = DEFAULT_SEED, cpu_compat: bool | None = None) -> None:
        """Set up Megatron's ``parallel_state`` for this topology in a rank with torch.distributed initialized.

        Seeds like Megatron-LM's ``_set_random_seed``: ``seed + 100 * pp_rank`` into
        ``random``, ``numpy``, ``torch`` and Megatron's model-parallel RNG tracker
        (``seed=None`` skips seeding). ``cpu_compat=None`` turns the ``cpu_compat`` patch on
        when CUDA is unavailable (the tracker needs it on CPU), True always, False never; every
        other ``lora_correct`` patch stays as it is in this process (off if never applied), so
        a plain testbed stays plain Megatron. Nothing here is reverted by :meth:`teardown`.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                f"Topology({self}).initialize(): torch.distributed is not initialized; use Topology.world()"
            )
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"topology {str(self)!r} needs {self.world_size} ranks but the world has {dist.get_world_size()}; "
                f"launch with world_size={self.world_size}"
            )
        from megatron.core import parallel_state  # first: an env-driven activation runs on this import

        if cpu_compat if cpu_compat is not None else not torch.cuda.is_available():
            _enable_cpu_compat()

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )
        if seed is not None:
            _seed_everything(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())

    @staticmethod
    def teardown() -> None:
        """Destroy Megatron's model-parallel state: its groups, buffers and RNG tracker states (safe if never
        initialized)."""
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.destroy_model_parallel()
        tensor_parallel.get_cuda_rng_tracker().reset()

    @staticmethod
    def process_groups() -> Any:
        """Megatron's ``ProcessGroupCollection`` of the initialized groups (tp, pp, cp, ep, expt_tp, dp, ...).

        What Megatron APIs taking ``pg_collection`` expect. Megatron-Core 0.13 has no such
        class (its groups are split over ``ModelCommProcessGroups`` / ``GradCommProcessGroups``):
        there this raises ``RuntimeError``; use the ``parallel_state`` getters instead.
        """
        from megatron.core import process_groups_config

        collection = getattr(process_groups_config, "ProcessGroupCollection", None)
        if collection is None:
            raise RuntimeError(
                "this Megatron-Core has no process_groups_config.ProcessGroupCollection; "
                "use the megatron.core.parallel_state getters (get_tensor_model_parallel_group(), ...)"
            )
        return collection.use_mpu_process_groups()

    @contextlib.contextmanager
    def world(
        self,
        *,
        seed: int | None = DEFAULT_SEED,
        cpu_compat: bool | None = None,
        timeout_s: float | None = None,
        device: str = "cpu",
    ) -> Iterator["Topology"]:
        """In a rank started by ``run_world``: gloo process group (``device="cuda"``: NCCL, one GPU per rank) +
        :meth:`initialize`, torn down on exit."""
        from megatron_lora_patch.proof.testbed.rank import process_group

        with process_group(device, timeout_s=timeout_s):
            try:
                self.initialize(seed=seed, cpu_compat=cpu_compat)
                yield self
            finally:
                self.teardown()  # also after a half-done initialize, so the next world starts clean


def _enable_cpu_compat() -> None:
    """Turn on ``cpu_compat`` without changing whether any other patch is on."""
    from megatron_lora_patch import status
    from megatron_lora_patch.proof.testbed.patches import apply_only

    current = {row.patch: row.enabled for row in status()}
    if current.get("cpu_compat"):
        return
    # `apply` resolves every patch of the plugins; unlisted ones would take their default (on).
    apply_only({name for name, enabled in current.items() if enabled} | {"cpu_compat"})


def _seed_everything(seed: int) -> None:
    import random

    import numpy
    import torch
    from megatron.core import tensor_parallel

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
