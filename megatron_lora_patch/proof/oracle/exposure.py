"""Which topologies a mutation's bug changes anything on: the preflight refuses a mutation run that could only pass.

A mutation re-introduces a bug of one parallel domain: a missing TP sum changes nothing without tensor
parallelism, a rank-local token count nothing without DP or CP ranks. Run on a topology without its domain, the
mutated run equals the reference and PASSes, which reads as "the preflight cannot see this bug". So each mutation
names the topology conditions any one of which exposes it (`Mutation.exposed_by`, measured on every single-axis
two-rank topology: docs/preflight.md, "Mutations") and those its code does not model (`Mutation.unsupported`);
`refusal` turns a topology that misses them into the one-line UsageError message.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional


class Condition(NamedTuple):
    holds: Callable  # Topology -> bool
    gives: str  # what the topology has when it holds, as the refusal names it
    how: str  # the arguments that make it hold
    off: str = ""  # the arguments that make it fail (a condition a mutation may name as unsupported has one)


#: The topology conditions a mutation can name, by name.
CONDITIONS = {
    "tp": Condition(lambda t: t.tp > 1, "tensor parallelism", "--tensor-model-parallel-size 2 or more"),
    "pp": Condition(lambda t: t.pp > 1, "pipeline parallelism", "--pipeline-model-parallel-size 2 or more"),
    "cp": Condition(lambda t: t.cp > 1, "context parallelism", "--context-parallel-size 2 or more"),
    "dp": Condition(lambda t: t.dp > 1, "data parallelism", "the preflight's --data-parallel-size 2 or more"),
    "sp": Condition(lambda t: t.sp, "sequence parallelism", "--sequence-parallel", "no --sequence-parallel"),
    "etp": Condition(
        lambda t: t.etp > 1,
        "expert tensor parallelism",
        "--expert-tensor-parallel-size 2 or more (Megatron defaults it to the TP size)",
    ),
    # the expert-DP group differs from the dense DP x CP one exactly when tp != ep * etp
    "expert_dp": Condition(
        lambda t: t.expert_dp != t.dp * t.cp,
        "an expert data-parallel group other than the dense one",
        "--expert-model-parallel-size x --expert-tensor-parallel-size (it defaults to the TP size) other than "
        "--tensor-model-parallel-size, e.g. --expert-model-parallel-size 2",
    ),
}


def _gives(names) -> str:
    return " or ".join(CONDITIONS[name].gives for name in names)


def refusal(mutation, topology) -> Optional[str]:
    """The one-line reason `mutation` cannot show its bug on `topology` (None where it can): none of its
    `exposed_by` conditions holds (every world exposes a mutation that names none), or an `unsupported` one does."""
    blocking = [name for name in mutation.unsupported if CONDITIONS[name].holds(topology)]
    if blocking:
        return (f"mutation {mutation.name} does not model {_gives(blocking)} (your topology: {topology}); run it "
                f"with {' and '.join(CONDITIONS[name].off for name in blocking)}")
    if mutation.exposed_by and not any(CONDITIONS[name].holds(topology) for name in mutation.exposed_by):
        how = "; or ".join(CONDITIONS[name].how for name in mutation.exposed_by)
        return (f"mutation {mutation.name} changes nothing without {_gives(mutation.exposed_by)} (your topology: "
                f"{topology}); use {how}")
    return None
