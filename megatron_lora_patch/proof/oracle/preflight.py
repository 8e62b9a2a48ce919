"""`megatron-lora-patch preflight -- <your pretrain_gpt.py arguments>`: the oracle on YOUR model and topology.

Parses the arguments with Megatron-LM's own parser, builds your architecture through
Megatron's own config path (depth cut to the fewest layers that hold every layer kind; a
model still over memory or --max-parameters also gets fewer routed experts, a smaller
vocabulary, then narrower widths, each only as far as needed, and says so), runs K LoRA
training steps at your topology (TP, SP, PP, CP, EP, ETP, dtype from the arguments; DP as
--data-parallel-size) and on one rank, with the same data (the first tokens of your
--data-path, in order; mock tokens with --mock-data), the LoRA settings your job reads
from MEGATRON_LORA_*, and compares the oracle's phases.
Exit 0 only on a match; 1 on a mismatch (naming the phase, layer and parameter that
drift most); 2 on bad arguments or a model too large for this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from typing import Any, Optional

from megatron_lora_patch.proof.oracle import exposure, preflight_device
from megatron_lora_patch.proof.oracle.thresholds import BF16_TOPOLOGY_FACTOR
from megatron_lora_patch.runtime.errors import UsageError

GIB = 1024**3
DEVICE_WORDS = {"cpu": "CPU + gloo", "cuda": "one GPU per rank + NCCL"}
_WEIGHT = re.compile(r"[0-9.eE+-]+")  # a blend's weight in --data-path, as opposed to a dataset prefix


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: Any  # testbed.args_model.ArgsModelSpec
    topology: Any  # testbed.topology.Topology
    lora: Any  # lora.config.LoraConfig the runs use
    patches: dict  # lora_correct patch -> on, as the user's environment resolves it
    lora_changes: tuple  # (field, user's value, value used)
    mutation: Any  # oracle.mutations.Mutation or None
    steps: int
    micro_batches: int
    timeout_s: float
    parameters: int
    data_path: Optional[str] = None  # the indexed dataset whose first tokens both runs read; None: mock data
    rank_warnings: str = "ignore"  # the ranks' warnings filter: Megatron's start-up notices are noise here
    device: str = "cpu"  # cpu: gloo ranks, the CPU stand-ins; cuda: one GPU per rank, NCCL, your kernels and spec

    @property
    def limits(self) -> Any:
        """The oracle's per-step thresholds for this dtype and step count (proof/oracle/thresholds.py)."""
        from megatron_lora_patch.proof.oracle.harness import OracleSettings

        return OracleSettings(steps=self.steps, dtype=self.spec.dtype)

    def describe(self) -> dict:
        args, spec = self.spec.args, self.spec
        return {
            "topology": str(self.topology),
            "world_size": self.topology.world_size,
            "device": f"{self.device}+{'gloo' if self.device == 'cpu' else 'nccl'}",
            "layers": {
                "yours": args.num_layers,
                "kept": spec.num_layers,
                "kinds": list(spec.kinds),
                "hybrid_pattern": {"yours": args.hybrid_layer_pattern, "kept": spec.hybrid_pattern}
                if spec.hybrid_pattern
                else None,
            },
            "width": {
                "hidden": args.hidden_size,
                "heads": args.num_attention_heads,
                "query_groups": args.num_query_groups if args.group_query_attention else args.num_attention_heads,
                "ffn": args.ffn_hidden_size,
                "experts": args.num_experts,
                "topk": args.moe_router_topk if args.num_experts else None,
                "vocab": spec.padded_vocab_size,
            },
            "seq_length": spec.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "micro_batches": self.micro_batches,
            "dtype": spec.dtype,
            "steps": self.steps,
            "parameters": self.parameters,
            "data": self.data_path or "mock",
            "lora": dataclasses.asdict(self.lora),
            "patches": self.patches,
            "mutation": self.mutation.name if self.mutation else None,
            "cut": [{"setting": option, "yours": yours, "preflight": run} for option, yours, run in spec.cuts],
            "changed": [
                {"setting": name, "yours": str(old), "preflight": str(new)}
                for name, old, new in [*spec.changes(), *self.lora_changes]
            ],
        }

    def summary(self) -> str:
        described, spec = self.describe(), self.spec
        kinds = ", ".join(f"{index}: {kind}" for index, kind in enumerate(spec.kinds))
        lines = [
            f"preflight: {str(self.topology)} ({self.topology.world_size} ranks, {DEVICE_WORDS[self.device]}) against "
            f"1 rank, {self.steps} steps, {spec.dtype}, ~{self.parameters / 1e6:.1f}M parameters at world size 1",
            f"  layers: {spec.num_layers} of your {spec.args.num_layers} "
            f"(every layer kind once: {kinds}); " + ("cut to fit, below" if spec.cuts else "widths unchanged"),
        ]
        if spec.cuts:
            lines.append("  cut to fit memory / --max-parameters: " + ", ".join(
                f"{option} {yours} -> {run}" for option, yours, run in spec.cuts
            ))
        if spec.hybrid_pattern:
            lines.append(f"  hybrid layer pattern: {spec.hybrid_pattern!r} of your {spec.args.hybrid_layer_pattern!r}")
        lines.append(f"  data: {'the first tokens of ' + self.data_path if self.data_path else 'mock'}")
        lines.append("  patches (from your environment): " + ", ".join(name for name, on in self.patches.items() if on))
        lines.append(f"  LoRA (from your environment): {lora_settings(self.lora)}")
        lines += [
            f"  changed: {item['setting']} {item['yours']} -> {item['preflight']}" for item in described["changed"]
        ]
        if spec.dtype == "bf16":
            lines.append(
                f"  bf16: judged against an fp32 world-1 run, within {BF16_TOPOLOGY_FACTOR:g}x the one-rank bf16 "
                "run's own error (proof/oracle/bf16_rule.py)"
            )
        if self.mutation:
            lines.append(f"  mutation: {self.mutation.name} ({self.mutation.bug})")
        return "\n".join(lines)


def lora_settings(lora) -> str:
    """The LoRA settings a preflight tests, in the words of their MEGATRON_LORA_* variables (echoed so a
    PASS says what it covered: the variables a job forgot are visible here)."""
    rslora = " (rsLoRA)" if lora.rslora else ""
    text = f"rank {lora.rank}, alpha {lora.alpha:g}{rslora}, targets {','.join(lora.targets)}"
    extras = [(name, getattr(lora, name)) for name in ("exclude", "rank_pattern", "alpha_pattern", "modules_to_save")]
    return text + "".join(f", {name} {value}" for name, value in extras if value)


def make_plan(options: argparse.Namespace, environ=None) -> Plan:
    """Everything checked before any rank starts; every problem is one UsageError."""
    from megatron_lora_patch.proof.testbed.args_check import check_widths
    from megatron_lora_patch.proof.testbed.args_model import ArgsModelSpec
    from megatron_lora_patch.proof.testbed.args_parse import parse_megatron_args
    from megatron_lora_patch.proof.testbed.topology import TopologyError

    argv = list(options.megatron_args or [])
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise UsageError(
            "preflight needs your pretrain_gpt.py arguments after --, e.g. preflight -- --num-layers 32 ..."
        )
    device = preflight_device.resolve_device(getattr(options, "device", "cpu"))
    mutation = _mutation(options.mutation)
    lora, lora_changes = _compared_lora(environ)
    patches = _user_patches()
    topology_of = functools.partial(_topology_of, options.data_parallel_size)
    try:
        args = parse_megatron_args(argv, topology_of)
        topology = topology_of(args)
        preflight_device.check_world(topology.world_size, device, mutation, args)
        spec = ArgsModelSpec.from_args(args, layers=options.layers, seq_length=options.seq_length, cpu=device == "cpu")
        spec, parameters = _fit(spec, topology, options, lora.rank, cut_vocab=_data_prefix(args) is None)
        topology.validate(
            num_experts=spec.num_experts, num_layers=spec.num_layers, seq_length=spec.seq_length, max_world=None
        )
        spec.check(topology)
        check_widths(spec, topology)  # Megatron asserts these only when a rank builds the layer
    except TopologyError as error:
        raise UsageError(str(error)) from None
    _check_mutation(mutation, args, topology)
    plan = Plan(
        spec,
        topology,
        lora,
        patches,
        lora_changes,
        mutation,
        options.steps,
        options.micro_batches,
        options.timeout,
        parameters,
        _data_prefix(args),
        "default" if getattr(options, "verbose", False) else "ignore",
        device,
    )
    if plan.data_path:
        _check_data(plan)
    return plan


def _check_mutation(mutation, args: argparse.Namespace, topology) -> None:
    """One UsageError where the user's model or topology lacks what the mutation's bug lives in (it would change
    nothing, so the run could only pass), or has what its code does not model (`exposure.refusal`)."""
    if mutation is None:
        return
    for flag, gives in mutation.requirements():
        if not getattr(args, flag[2:].replace("-", "_"), None):
            raise UsageError(f"mutation {mutation.name} needs {gives} ({flag}); your arguments have no {flag}")
    problem = exposure.refusal(mutation, topology)
    if problem:
        raise UsageError(problem)


def _compared_lora(environ) -> tuple:
    """The LoRA settings the comparison runs with (the user's, changed) and each change as
    (variable, yours, compared): dropout masks cannot match across topologies, and a zero B would
    make A's first grads trivially zero."""
    from megatron_lora_patch.lora.config import LoraConfig

    try:
        user_lora = LoraConfig.from_env(environ)
    except ValueError as error:
        raise UsageError(str(error)) from None
    lora = dataclasses.replace(user_lora, dropout=0.0, b_init="nonzero")
    lora_changes = tuple(
        (f"MEGATRON_LORA_{name.upper()}", getattr(user_lora, name), getattr(lora, name))
        for name in ("dropout", "b_init")
        if getattr(user_lora, name) != getattr(lora, name)
    )
    return lora, lora_changes


def _data_prefix(args: argparse.Namespace) -> Optional[str]:
    """The first dataset prefix of --data-path (a blend lists weight prefix pairs); None for mock data."""
    if getattr(args, "mock_data", False) or not getattr(args, "data_path", None):
        return None
    return next((item for item in args.data_path if not _WEIGHT.fullmatch(item)), None)


def _check_data(plan: Plan) -> None:
    """Read the tokens both runs will read before any rank starts: a bad path or vocabulary is one UsageError."""
    from megatron_lora_patch.proof.testbed.data import read_corpus

    tokens = plan.micro_batches * plan.topology.dp * plan.spec.args.micro_batch_size * (plan.spec.seq_length + 1)
    try:
        read_corpus(plan.data_path, tokens * plan.steps, plan.spec.vocab_size)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _user_patches() -> dict:
    """Which lora_correct patches a training job started with this environment gets (defaults, then
    MEGATRON_LORA_PATCH_<NAME> / MEGATRON_LORA_DISABLED_PATCHES; a bad value is one UsageError line)."""
    from megatron_lora_patch.plugins import lora_correct
    from megatron_lora_patch.runtime import flags

    defaults = {spec.name: spec.default for spec in lora_correct.megatron_lora_patch_patches()}
    return {name: decision[0] for name, decision in flags.resolve_enabled(defaults).items()}


def _mutation(name: Optional[str]):
    from megatron_lora_patch.proof.oracle.harness import mutations_named

    if name is None:
        return None
    try:
        return mutations_named([name])[0]
    except ValueError as error:
        raise UsageError(f"--mutation: {error}") from None


def _topology_of(data_parallel_size: Optional[int], args: argparse.Namespace):
    """The world of the user's parallel sizes (one machine: dp as asked, or the smallest the expert grid needs)."""
    from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError

    tp = args.tensor_model_parallel_size
    try:
        return Topology(
            tp=tp,
            pp=args.pipeline_model_parallel_size,
            cp=args.context_parallel_size,
            dp=data_parallel_size,
            ep=args.expert_model_parallel_size,
            etp=(args.expert_tensor_parallel_size or tp) if args.num_experts else 1,  # Megatron defaults it to tp
            sp=bool(args.sequence_parallel) and tp > 1,
        )
    except TopologyError as error:
        raise UsageError(str(error)) from None


def _fit(spec, topology, options: argparse.Namespace, rank: int, cut_vocab: bool) -> tuple:
    """(the spec, its estimated world-1 parameters): cut by `args_cuts.cut_to_fit` to the smaller of the memory
    and --max-parameters budgets unless the user chose the depth (--layers); UsageError with the smallest
    comparison that fits if the world-1 reference cannot fit memory."""
    import psutil

    from megatron_lora_patch.proof.testbed.args_cuts import cut_to_fit, estimate_parameters

    limit_gib = options.max_memory_gib
    available = limit_gib * GIB if limit_gib is not None else psutil.virtual_memory().available
    bytes_per = (2 if spec.dtype == "bf16" else 4) * 2  # the weights, and their fp32 draws / copies alongside
    if options.layers is None:
        budget = int(available // bytes_per)  # widths are kept where memory allows, unless the user sets a budget
        if options.max_parameters is not None:
            budget = min(budget, int(options.max_parameters * 1e6))
        spec = cut_to_fit(spec, budget, topology, cut_vocab, rank)
    parameters = estimate_parameters(spec)
    if parameters * bytes_per <= available:
        return spec, parameters
    distinct = len(set(spec.kinds))
    minimal = dataclasses.replace(spec, kinds=tuple(dict.fromkeys(spec.kinds)))
    needed = parameters * bytes_per / GIB
    if spec.num_layers > distinct and estimate_parameters(minimal) * bytes_per <= available:
        hint = f"use --layers {distinct} (the fewest that hold every layer kind)"
    else:
        hint = "even the fewest layers do not fit at these widths: run the preflight on a machine with more memory"
    raise UsageError(
        f"the world-1 reference cannot fit: ~{parameters / 1e6:.3g}M parameters need ~{needed:.3g} GiB, "
        f"{available / GIB:.3g} GiB available; {hint}"
    )
