"""Adapter metadata follows the param wherever Megatron copies its TP attributes."""

import torch

from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, adapter_info, tag
from megatron_lora_patch.plugins.lora_correct import PATCH_NAMES
from megatron_lora_patch.runtime import registry


def test_fp32_main_copy_keeps_adapter_metadata():
    """Float16Optimizer builds main params with tensor_parallel.copy_tensor_model_parallel_attributes."""
    import megatron.core.tensor_parallel as tensor_parallel

    runtime = registry.Runtime()
    runtime.apply(["lora_correct"], enable={name: name == "lora_linear" for name in PATCH_NAMES})
    try:
        factor = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
        info = AdapterParamInfo("decoder.layers.0.mlp.experts.linear_fc2", "B", True, "expert_tp", None, True)
        tag(factor, info)
        main = factor.detach().float()
        tensor_parallel.copy_tensor_model_parallel_attributes(main, factor)
        assert adapter_info(main) is info
        plain = torch.nn.Parameter(torch.zeros(2))
        tensor_parallel.set_tensor_model_parallel_attributes(plain, True, 0, 1)
        plain_main = torch.zeros(2)
        tensor_parallel.copy_tensor_model_parallel_attributes(plain_main, plain)
        assert adapter_info(plain_main) is None  # non-adapters get no adapter metadata...
        copied = (plain_main.tensor_model_parallel, plain_main.partition_dim, plain_main.partition_stride)
        assert copied == (True, 0, 1)  # ...and still Megatron's own TP attributes
    finally:
        runtime.revert()
    reverted = torch.zeros(2, 3)
    tensor_parallel.copy_tensor_model_parallel_attributes(reverted, factor)
    assert adapter_info(reverted) is None
