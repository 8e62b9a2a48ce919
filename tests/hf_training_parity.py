"""LoRA training parity against Hugging Face `transformers` + `peft` (libraries nobody here wrote).

The same base weights (`hf_llama.llama_for`: the testbed's logical weights under Llama names) train the same
adapters on the same data for a few optimizer steps, once in Megatron (the testbed's training loop,
`runner.run_jobs`, with the production patches as `MEGATRON_PLUGINS=lora_correct` sets them) and once in
`peft`; the per-step losses and the adapters after every step are compared.

Both sides run in fp32 with the same Adam (betas 0.9 / 0.999, `adam_eps`, no weight decay, no clipping:
Megatron's Adam on a host is torch's), and the Megatron adapters' initial values are copied into peft's (via the
package's PEFT export layout, `lora.exchange.peft.to_peft`). The adapters are standard PEFT LoRA
(`separate_projections`: q / k / v and gate / up each with their own A and B, as peft trains them; the default
shared A would train differently by design). What the data is, and how peft computes the loss of one global batch
from it, is the caller's (`step_loss`): e.g. packed rows run one sequence at a time (tests/test_hf_parity_packed.py).
Megatron's adapters are put back together from every rank's shards (any TP); DoRA's magnitudes (`dora` in
`lora_options`, PEFT's `use_dora`) are split per projection like the B rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_lora_patch.proof.oracle.harness import oracle_job
from megatron_lora_patch.proof.oracle.settings import OracleSettings
from megatron_lora_patch.proof.testbed.runner import Job, run_jobs
from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings

#: Every module a default LoRA target adapts, under Llama's names.
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class ParitySetup:
    """What both sides share: the model, the seed of its weights, adapters and data, the optimizer's knobs,
    and `lora_options`: LoraConfig fields beyond rank / alpha (separate projections always on)."""

    spec: object
    seed: int = 1234
    steps: int = 3
    global_batch_size: int = 4
    lr: float = 1e-2
    adam_eps: float = 1e-4
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_options: tuple = ()

    def train_settings(self) -> TrainSettings:
        """Megatron's side: Adam without weight decay or clipping, adapters recorded after every step."""
        return TrainSettings(
            steps=self.steps, seed=self.seed, global_batch_size=self.global_batch_size, lr=self.lr,
            adam_eps=self.adam_eps, weight_decay=0.0, clip_grad=0.0, capture=Capture(params_every_step=True),
        )

    def oracle_settings(self) -> OracleSettings:
        options = dict(self.lora_options, separate_projections=True)
        return OracleSettings(
            seed=self.seed, lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_options=tuple(options.items())
        )

    def description(self) -> dict:
        """What the PEFT layout conversion needs: the LoRA settings and the model's shape (SwiGLU)."""
        from megatron_lora_patch.lora.config import LoraConfig

        lora = LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, **dict(self.oracle_settings().lora_options))
        return dict(
            lora.description(), num_layers=self.spec.num_layers, num_attention_heads=self.spec.num_attention_heads,
            num_query_groups=self.spec.num_query_groups, kv_channels=self.spec.kv_channels, gated_linear_unit=True,
        )


def _logical(records: List[dict], phase: str, step: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """The logical adapter tensors of one phase ('initial_params', or step `step`'s 'params') from every rank's
    shards (TP slices put back where `shards.Shard` says they sit)."""
    from megatron_lora_patch.proof.testbed.shards import assemble_logical

    rank_items, shapes = [], {}
    for record in records:
        tensors = record[phase] if step is None else record["steps"][step][phase]
        items = [(record["shards"][name], tensor) for name, tensor in tensors.items()]
        for shard, tensor in items:
            shape = list(tensor.shape)
            if shard.partition_dim is not None:
                shape[shard.partition_dim] *= shard.size
            shapes[shard.logical_name] = tuple(shape)
        rank_items.append(items)
    return assemble_logical(rank_items, shapes)


def _peft_tensors(params: Dict[str, torch.Tensor], description: dict) -> Dict[str, torch.Tensor]:
    """PEFT-named adapter tensors of the logical adapter parameters (`<module>.lora.A` / `.B`, DoRA's `.m`)."""
    from megatron_lora_patch.lora.exchange.peft import to_peft

    logical: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in params.items():
        module, factor = name.rsplit(".lora.", 1)
        logical.setdefault(module, {})[factor] = tensor
    pairs = {module: (factors["A"], factors["B"]) for module, factors in logical.items()}
    tensors, _ = to_peft(pairs, dict(description, dora=False))  # the export refuses DoRA: m is split below
    for module, factors in logical.items():
        if "m" in factors:
            tensors.update(_peft_magnitudes(module, factors["m"], description))
    return dict(sorted(tensors.items()))


def _peft_magnitudes(module: str, magnitude: torch.Tensor, description: dict) -> Dict[str, torch.Tensor]:
    """DoRA's magnitude of a Megatron module, per PEFT projection (rows split as the module's B rows are)."""
    from megatron_lora_patch.lora.adapters.layouts import fc1_to_gate_up, qkv_mixed_to_separate

    layer, linear = module.split(".")[2], module.rsplit(".", 1)[-1]
    prefix = f"base_model.model.model.layers.{layer}."
    if linear == "linear_qkv":
        heads, groups, channels = (description[key] for key in ("num_attention_heads", "num_query_groups",
                                                                 "kv_channels"))
        parts = [part[:, 0] for part in qkv_mixed_to_separate(magnitude[:, None], heads, groups, channels)]
        paths = [f"self_attn.{name}_proj" for name in "qkv"]
    elif linear == "linear_fc1":
        parts, paths = list(fc1_to_gate_up(magnitude)), ["mlp.gate_proj", "mlp.up_proj"]
    else:
        parts, paths = [magnitude], ["self_attn.o_proj" if linear == "linear_proj" else "mlp.down_proj"]
    return {f"{prefix}{path}.lora_magnitude_vector": part.contiguous() for path, part in zip(paths, parts)}


def run_megatron(setup: ParitySetup, topologies: Sequence[str]) -> Dict[str, dict]:
    """Per topology: `initial` (PEFT tensors before the first step), `losses` (each step's reported loss, a
    global token mean) and `adapters` (PEFT tensors after each step), from every rank's adapters."""
    context = functools.partial(oracle_job, setup.oracle_settings(), None)
    jobs = [Job(setup.spec, topology, setup.train_settings(), context=context) for topology in topologies]
    description, results = setup.description(), {}
    for topology, records in zip(topologies, run_jobs(jobs, warnings="ignore")):
        results[topology] = {
            "initial": _peft_tensors(_logical(records, "initial_params"), description),
            "losses": [step["lm_loss"] for step in records[0]["steps"]],
            "adapters": [
                _peft_tensors(_logical(records, "params", step), description) for step in range(setup.steps)
            ],
        }
    return results


def peft_model(setup: ParitySetup, initial: Dict[str, torch.Tensor]):
    """The HF Llama with the setup's base weights and peft LoRA adapters holding `initial` (fp32, no dropout)."""
    import hf_llama
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = LoraConfig(
        r=setup.lora_rank, lora_alpha=setup.lora_alpha, target_modules=PEFT_TARGETS, lora_dropout=0.0,
        use_rslora=dict(setup.lora_options).get("rslora", False), use_dora=dict(setup.lora_options).get("dora", False),
    )
    model = get_peft_model(hf_llama.llama_for(setup.spec, setup.seed), config)
    result = set_peft_model_state_dict(model, initial)
    assert not result.unexpected_keys, result.unexpected_keys
    loaded = {key for key in model.state_dict() if "lora_" in key}
    assert len(loaded) == len(initial), (sorted(loaded), sorted(initial))
    return model


#: `step_loss(model, step)`: peft's loss of step `step`'s global batch (a scalar tensor, normalized globally).
StepLoss = Callable[[torch.nn.Module, int], torch.Tensor]


def run_peft(setup: ParitySetup, initial: Dict[str, torch.Tensor], step_loss: StepLoss) -> dict:
    """`losses` and `adapters` (PEFT tensors after each step) of `setup.steps` Adam steps in peft.

    One thread: the many tiny forwards are 15x slower when torch's threads outnumber the 2 CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _peft_steps(setup, peft_model(setup, initial), step_loss)
    finally:
        torch.set_num_threads(threads)


def _peft_steps(setup: ParitySetup, model, step_loss: StepLoss) -> dict:
    from peft import get_peft_model_state_dict

    trained = [param for name, param in model.named_parameters() if param.requires_grad]
    assert trained and all("lora_" in name for name, param in model.named_parameters() if param.requires_grad)
    optimizer = torch.optim.Adam(trained, lr=setup.lr, betas=(0.9, 0.999), eps=setup.adam_eps, weight_decay=0.0)
    losses, adapters = [], []
    for step in range(setup.steps):
        optimizer.zero_grad()
        loss = step_loss(model, step)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        adapters.append({name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()})
    return {"losses": losses, "adapters": adapters}


def _relative(candidate: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """Relative L2 error of all adapter tensors together (the oracle's `rel_l2`); the names must agree."""
    assert set(candidate) == set(reference), sorted(set(candidate) ^ set(reference))
    names = sorted(reference)
    expected = torch.cat([reference[name].flatten() for name in names])
    return float((torch.cat([candidate[name].flatten() for name in names]) - expected).norm() / expected.norm())


def errors(reference: dict, candidate: dict) -> List[Dict[str, float]]:
    """Per step: `loss` (relative error of the loss) and `adapters` (relative L2 error of all adapter tensors)."""
    assert len(reference["losses"]) == len(candidate["losses"]) == len(candidate["adapters"])
    return [
        {"loss": abs(loss - expected_loss) / abs(expected_loss), "adapters": _relative(adapters, expected)}
        for loss, expected_loss, adapters, expected in zip(
            candidate["losses"], reference["losses"], candidate["adapters"], reference["adapters"]
        )
    ]


def assert_every_step_within(reference: dict, candidate: dict, steps: int, loss_tolerance: float,
                             adapter_tolerance: float, label: str) -> None:
    """Each of the `steps` steps: the loss and the adapters of `candidate` within the tolerances of `reference`."""
    per_step = errors(reference, candidate)
    print(label, per_step)
    assert len(per_step) == steps, (label, per_step)
    for step, error in enumerate(per_step):
        assert error["loss"] <= loss_tolerance, (label, step, error)
        assert error["adapters"] <= adapter_tolerance, (label, step, error)
