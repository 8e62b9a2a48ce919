"""`lora.megatron_checkpoint.check_match`: a checkpoint's adapters against this run's, by key and shape."""

from types import SimpleNamespace

import pytest

from megatron_lora_patch.lora.checkpoints.megatron import AdapterMismatchError, check_match
from megatron_lora_patch.runtime.errors import UsageError

QKV, FC1 = "decoder.layers.self_attention.linear_qkv.lora", "decoder.layers.mlp.linear_fc1.lora"


def _entries(rank: int, prefixes) -> dict:
    shapes = {"A": (2, rank, 64), "B": (2, 128, rank)}
    return {
        f"{prefix}.{factor}": SimpleNamespace(global_shape=shape)
        for prefix in prefixes
        for factor, shape in shapes.items()
    }


def test_same_adapters_match():
    check_match(_entries(4, [QKV, FC1]), _entries(4, [QKV, FC1]), "ckpt")


@pytest.mark.parametrize(
    "run, saved, described",
    [
        (_entries(8, [QKV]), _entries(4, [QKV]), ("rank 4 on linear_qkv", "rank 8 on linear_qkv")),
        (_entries(4, [QKV]), _entries(4, [QKV, FC1]), ("rank 4 on linear_fc1, linear_qkv", "rank 4 on linear_qkv")),
        (_entries(4, [QKV, FC1]), _entries(4, [QKV]), ("rank 4 on linear_qkv", "rank 4 on linear_fc1, linear_qkv")),
    ],
    ids=["rank", "fewer-targets", "more-targets"],
)
def test_mismatch_is_one_usage_line_naming_both(run, saved, described):
    with pytest.raises(AdapterMismatchError) as caught:
        check_match(run, saved, "ckpt/iter_0000004")
    assert isinstance(caught.value, UsageError)
    assert str(caught.value) == (
        f"the LoRA adapters in ckpt/iter_0000004 ({described[0]}) do not match this run's ({described[1]}); "
        "set MEGATRON_LORA_RANK and MEGATRON_LORA_TARGETS as when it was saved, "
        "or fine-tune from a base checkpoint without adapters"
    )
