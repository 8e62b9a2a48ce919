"""Collectives and step time of LoRA-wrapped Megatron linears (issue 4 benchmark; prints figures).

Part 1, collectives: on a 2-rank gloo world (TP2, and TP2 with sequence parallelism), one
forward + backward of a ColumnParallelLinear and a RowParallelLinear in four variants:
- `frozen`: the base weight frozen, no adapter (what LoRA fine-tuning starts from);
- `full`: the base weight trainable (full fine-tuning);
- `lora-keep` / `lora-regather`: frozen base + adapter, `sp_input` keep / regather;
- `te-branch`: the frozen Megatron base plus the branch used beside Transformer Engine
  linears (`lora.te`), whose own collectives carry [tokens, r] (TE itself is not needed).
Every torch.distributed collective (and Megatron's module-level aliases of
`all_gather_into_tensor` / `reduce_scatter_tensor`) is counted by op with its payload in
bytes (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the full
input). Goal: lora-keep = frozen, lora-regather = full. Not counted: the once-per-step
coalesced SUM of replicated adapter grads (`finalize_grads` patch, one all-reduce per
(domain, dtype) bucket, like DP grad sync).

Part 2, step time: world size 1, a GPT with hidden >= 1024, one forward+backward (loss
summed) with LoRA (default targets, rank 16) vs the same model frozen without adapters
(both with the embedding output requiring grad, so the frozen base runs its dgrad chain),
timed alternately in one run (medians), next to the FLOP ratio measured with
`torch.utils.flop_counter.FlopCounterMode` on the same steps.

Usage: python benchmarks/lora_collectives.py [--steps 5] [--hidden 1024] [--seq 256]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import torch

from megatron_lora_patch.proof.testbed.launcher import run_world

SEQ, BATCH, HIDDEN, FFN = 16, 2, 64, 128
VARIANTS = ("frozen", "full", "lora-keep", "lora-regather", "te-branch")
_COLLECTIVES = {  # torch.distributed function -> op label
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


class CollectiveCounter:
    """Counts collectives by op and bytes while active; nested calls (an emulation) count once."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self._depth = threading.local()
        self._restore: list = []

    def _payload(self, label: str, args: tuple, kwargs: dict) -> int:
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
            item for a in args if isinstance(a, (list, tuple)) for item in a if isinstance(item, torch.Tensor)
        ]
        if label == "all_gather" and isinstance(args[0], (list, tuple)):
            return sum(t.nbytes for t in args[0])  # list form: the gathered outputs
        return max((t.nbytes for t in tensors), default=0)  # the full-size tensor of the call

    def _counting(self, label: str, function):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                self.calls[label] += 1
                self.bytes[label] += self._payload(label, args, kwargs)
            self._depth.value = depth + 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth.value = depth

        return counted

    def _replace(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, self._counting(label, original))

    def __enter__(self) -> "CollectiveCounter":
        import torch.distributed as dist
        from megatron.core import utils
        from megatron.core.tensor_parallel import layers, mappings

        for name, label in _COLLECTIVES.items():
            if hasattr(dist, name):
                self._replace(dist, name, label)
        for module in (layers, mappings, utils):  # module-level aliases bound at import
            for name, label in (("dist_all_gather_func", "all_gather"), ("dist_reduce_scatter_func", "reduce_scatter")):
                if hasattr(module, name):
                    self._replace(module, name, label)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)

    def summary(self) -> str:
        if not self.calls:
            return "none"
        return ", ".join(f"{op} x{count} ({self.bytes[op]} B)" for op, count in sorted(self.calls.items()))


def _apply_patches() -> None:
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(("cpu_compat", "lora_linear"))


def _layer(kind: str, variant: str, sequence_parallel: bool):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers.attach import attach_adapters

    config = ModelParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=sequence_parallel, use_cpu_initialization=True
    )
    init = torch.nn.init.xavier_normal_
    group = parallel_state.get_tensor_model_parallel_group()
    holder = torch.nn.Module()
    if kind == "column":
        holder.linear_fc1 = ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=init, bias=False, gather_output=False, tp_group=group
        )
    else:
        holder.linear_fc2 = RowParallelLinear(
            FFN,
            HIDDEN,
            config=config,
            init_method=init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
        )
    layer = next(iter(holder.children()))
    if variant.startswith("lora"):
        attach_adapters(holder, LoraConfig(rank=8, sp_input=variant.split("-")[1]))
    elif variant == "te-branch":
        attach_adapters(holder, LoraConfig(rank=8))
        return _TEBranch(layer, layer._modules.pop("lora"), kind, sequence_parallel)
    else:
        for param in holder.parameters():
            param.requires_grad_(variant == "full")
    return layer


class _TEBranch(torch.nn.Module):
    """A frozen Megatron base plus the LoRA branch `lora.te` computes beside a TE linear."""

    def __init__(self, base, adapter, kind: str, sequence_parallel: bool) -> None:
        super().__init__()
        self.base, self.adapter, self.kind, self.sequence_parallel = base, adapter, kind, sequence_parallel

    def forward(self, x):
        from megatron_lora_patch.lora.layers import te

        term = te.column_term if self.kind == "column" else te.row_term
        output, bias = self.base(x)
        return output + term(self.adapter, x, self.sequence_parallel), bias


def count_collectives(rank: int, world: int) -> dict:
    """Per (setting, layer, variant): the collectives of one forward + backward."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    _apply_patches()
    figures = {}
    for setting, sequence_parallel in (("tp2", False), ("tp2-sp", True)):
        with Topology.parse(setting).world():
            for kind in ("column", "row"):
                for variant in VARIANTS:
                    layer = _layer(kind, variant, sequence_parallel)
                    if kind == "column":
                        seq = SEQ // 2 if sequence_parallel else SEQ
                        x = torch.randn(seq, BATCH, HIDDEN, requires_grad=True)
                    else:
                        x = torch.randn(SEQ, BATCH, FFN // 2, requires_grad=True)
                    with CollectiveCounter() as counter:
                        output, _ = layer(x)
                        output.sum().backward()
                    figures[(setting, kind, variant)] = (dict(counter.calls), dict(counter.bytes))
    return figures


def _step(model, batch) -> None:
    tokens, positions, mask, labels = batch
    torch.autograd.backward(model(tokens, positions, mask, labels=labels).sum())


def step_times(rank: int, world: int, hidden: int, seq: int, steps: int) -> dict:
    """Median step time and measured FLOPs of LoRA vs frozen base and DoRA vs LoRA, timed alternately."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lora_patch.lora import config as lora_config
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    _apply_patches()
    spec = TinyGPTSpec(
        hidden_size=hidden,
        num_attention_heads=hidden // 64,
        num_query_groups=hidden // 256,
        ffn_hidden_size=hidden * 8 // 3 // 64 * 64,
        seq_length=seq,
        num_layers=2,
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (1, seq), generator=generator)
    positions = torch.arange(seq).unsqueeze(0)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1).view(1, 1, seq, seq)
    batch = (tokens, positions, mask, tokens.roll(-1, 1))
    with Topology().world():
        import megatron_lora_patch

        models = {}
        for name, dora in (("lora", False), ("dora", True)):  # DoRA (issue 37 item 6): the same adapters plus m
            lora_config.set_active(lora_config.LoraConfig(rank=16, dora=dora))
            models[name] = build_model(spec)[0]
        lora_config.set_active(None)
        megatron_lora_patch.revert(["lora_linear"])  # build the frozen base without adapters
        models["frozen"] = build_model(spec)[0]
        for param in models["frozen"].parameters():
            param.requires_grad_(False)
        _apply_patches()  # back on for the LoRA model (the frozen one has no adapter: a plain call)
        for model in models.values():
            # The frozen base has nothing to train; its step is forward + the input-grad chain a
            # trainable layer upstream would need. The same for both models, so the ratio is fair.
            model.embedding.register_forward_hook(lambda _module, _inputs, output: output.requires_grad_(True))
        flops = {}
        for name, model in models.items():
            with FlopCounterMode(display=False) as counter:
                _step(model, batch)
            flops[name] = counter.get_total_flops()
        times = collections.defaultdict(list)
        for _ in range(steps + 1):  # the first round warms up
            for name, model in models.items():
                start = time.perf_counter()
                _step(model, batch)
                times[name].append(time.perf_counter() - start)
        return {
            "spec": spec,
            "flops": flops,
            "median_s": {name: statistics.median(values[1:]) for name, values in times.items()},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    options = parser.parse_args()

    figures = run_world(count_collectives, 2, name="collectives", timeout=600)[0]
    print(f"Collectives of one forward + backward (rank 0 of 2; layer {HIDDEN}x{FFN}, seq {SEQ}, batch {BATCH}, fp32)")
    print(f"{'setting':8} {'layer':7} {'variant':14} collectives")
    for (setting, kind, variant), (calls, sizes) in figures.items():
        text = ", ".join(f"{op} x{count} ({sizes[op]} B)" for op, count in sorted(calls.items())) or "none"
        print(f"{setting:8} {kind:7} {variant:14} {text}")
    for setting in ("tp2", "tp2-sp"):
        for kind in ("column", "row"):
            row = {variant: figures[(setting, kind, variant)] for variant in VARIANTS}
            keep_ok = row["lora-keep"] == row["frozen"]
            regather_ok = row["lora-regather"] == row["full"]
            extra = {op: count - row["frozen"][0].get(op, 0) for op, count in row["te-branch"][0].items()}
            extra_bytes = {op: size - row["frozen"][1].get(op, 0) for op, size in row["te-branch"][1].items()}
            te_text = (
                ", ".join(f"{op} x{count} ({extra_bytes[op]} B)" for op, count in sorted(extra.items()) if count)
                or "none"
            )
            print(
                f"{setting} {kind}: lora-keep == frozen: {keep_ok}; lora-regather == full: {regather_ok}; "
                f"te-branch adds: {te_text}"
            )

    timing = run_world(step_times, 1, args=(options.hidden, options.seq, options.steps), name="step-time", timeout=600)[
        0
    ]
    spec, flops, median = timing["spec"], timing["flops"], timing["median_s"]
    print(
        f"\nStep time, world size 1, CPU fp32, 1 thread: GPT hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, "
        f"{spec.num_layers} layers, heads {spec.num_attention_heads} / groups {spec.num_query_groups}, "
        f"seq {spec.seq_length}, "
        f"batch 1; LoRA rank 16 on qkv, proj, fc1, fc2; medians of {options.steps} alternating steps"
    )
    for name in ("frozen", "lora", "dora"):
        print(f"  {name:7} {median[name] * 1e3:9.1f} ms   {flops[name] / 1e9:8.3f} GFLOP")
    print(f"  LoRA / frozen: time {median['lora'] / median['frozen']:.3f}, FLOPs {flops['lora'] / flops['frozen']:.3f}")
    print(f"  DoRA / LoRA:   time {median['dora'] / median['lora']:.3f}, FLOPs {flops['dora'] / flops['lora']:.3f}")


if __name__ == "__main__":
    main()
