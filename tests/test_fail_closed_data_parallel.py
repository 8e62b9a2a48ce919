"""Fail closed on the data-parallel wrappers LoRA is not proven with: a fully sharded one (PyTorch FSDP2 through
`--use-torch-fsdp2`, Megatron FSDP through `--use-megatron-fsdp`) around a model with adapters stops with one line
when it is built, before it shards anything (`lora.layers.unsupported.refuse_sharded_data_parallel`, hooked by the
`finalize_grads` patch). Megatron's own `DistributedDataParallel` is what every proof here runs, and still wraps.

Each case is a fresh process: a tiny GPTModel built on one gloo rank with the plugin activated by the start-up hook,
wrapped in Megatron's DDP first, then in the wrapper under test: Megatron-Core's two FSDPs (refused by their own
`__init__`'s wrapper, before their set-up) and a wrapper of the user's own (refused by the base class's `__init__`,
which every wrapper calls). The control builds the same model with the `lora_linear` patch off (no adapters): no
wrapper is then refused by us, whatever it does next on a CPU.
"""

from __future__ import annotations

import pytest
from conftest import run_fresh

from megatron_lora_patch.runtime.errors import PREFIX

WRAP = """
import os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
import torch
from megatron.core import distributed
class CustomSharded(distributed.data_parallel_base._BaseDataParallel):  # a wrapper of the user's own
    def __init__(self, config, ddp_config, module, device=None):
        super().__init__(config=config, module=module)
distributed.CustomSharded = CustomSharded
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, build_model
from megatron_lora_patch.proof.testbed.topology import Topology
topology = Topology.parse("tp1")
with topology.world():
    (model,) = build_model(TinyGPTSpec(), topology)
    distributed.DistributedDataParallel(model.config, distributed.DistributedDataParallelConfig(), model)
    print("ddp wrapped", flush=True)
    distributed.{wrapper}(model.config, distributed.{ddp_config}(), module=model{device})
    print("sharded", flush=True)
"""

ON_CPU = ", device=torch.device('cpu')"  # Megatron FSDP's default device is the current CUDA device
WRAPPERS = {  # wrapper -> (its DP config class, extra arguments, the Megatron-LM flag the refusal names)
    "TorchFullyShardedDataParallel": ("TorchFullyShardedDataParallelConfig", "", "--use-torch-fsdp2"),
    "FullyShardedDataParallel": ("DistributedDataParallelConfig", ON_CPU, "--use-megatron-fsdp"),
    "CustomSharded": ("DistributedDataParallelConfig", "", ""),  # refused by the base class's __init__
}


def _wrap(wrapper: str):
    ddp_config, device, _ = WRAPPERS[wrapper]
    script = WRAP.format(wrapper=wrapper, ddp_config=ddp_config, device=device)
    return run_fresh(["-c", script], MEGATRON_PLUGINS="lora_correct,cpu_testbed")


def _assert_one_line(done, message: str) -> None:
    """Stopped with exactly one error line, no traceback (torch.distributed prefixes it with "[rank0]: ")."""
    lines = [line for line in done.stderr.splitlines() if PREFIX in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].endswith(PREFIX + message), done.stderr[-3000:]


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_fully_sharded_wrapper_around_adapters_stops_with_one_line(wrapper):
    done = _wrap(wrapper)
    flag = WRAPPERS[wrapper][2]
    named, fix = (f" ({flag})", f"leave out {flag}") if flag else (
        "", "wrap the model in megatron.core.distributed.DistributedDataParallel")
    _assert_one_line(
        done,
        f"LoRA is not supported with {wrapper}{named}: the adapters' grad sync, grad norm and checkpoints are "
        f"proven with Megatron's DistributedDataParallel only; {fix} (--use-distributed-optimizer shards the "
        "optimizer state)",
    )
    assert "ddp wrapped" in done.stdout.splitlines() and "sharded" not in done.stdout.splitlines()


CONTROL = """
for wrapper, ddp_config, device in {cases!r}:
    try:
        extra = {{"device": torch.device("cpu")}} if device else {{}}
        getattr(distributed, wrapper)(model.config, getattr(distributed, ddp_config)(), module=model, **extra)
        print(wrapper, "built", flush=True)
    except Exception as error:  # what the wrapper itself does on a CPU
        print(wrapper, "failed:", type(error).__name__, flush=True)
"""


def test_without_adapters_no_wrapper_is_refused():
    """The control, in one process: the same model with `lora_linear` off, wrapped in each wrapper. Whatever a
    wrapper does next on a CPU (PyTorch FSDP2 cannot place its mesh there), it is not refused by us."""
    cases = [(wrapper, ddp_config, device) for wrapper, (ddp_config, device, _) in WRAPPERS.items()]
    body = WRAP.split("    distributed.{wrapper}")[0].format(wrapper="", ddp_config="", device="")
    script = body + "\n".join("    " + line for line in CONTROL.format(cases=cases).splitlines())
    done = run_fresh(["-c", script], MEGATRON_PLUGINS="lora_correct,cpu_testbed", MEGATRON_LORA_PATCH_LORA_LINEAR="0")
    assert done.returncode == 0 and PREFIX not in done.stderr, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "ddp wrapped" in lines and "CustomSharded built" in lines, done.stdout[-3000:]
    assert all(any(line.startswith(f"{wrapper} ") for line in lines) for wrapper in WRAPPERS), done.stdout[-3000:]
