"""The LoRA term's autograd functions (megatron_lora_patch/lora/kernels.py) against plain autograd math.

Plain torch, no Megatron: the fused / in-place kernels must give the values and grads of
`base(x) + s * (x A^T) B^T` computed op by op (float64, so the only difference is the
summation order: measured <= 1e-15 relative; tolerance 1e-12), write in place exactly when
they claim to, and fail loudly (autograd's error) when an in-place write would be wrong.
Negative controls: the same comparison with the scale dropped, or with A's grad of the
other layer, misses by far more than 100x the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.adapters.kernels import add_up_projection, down_projection

TOLERANCE = 1e-12
TOKENS, IN, OUT, RANK, SCALE = 6, 5, 7, 3, 0.75


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    x = make(TOKENS, 1, IN).requires_grad_()
    return x, make(OUT, IN), make(RANK, IN).requires_grad_(), make(OUT, RANK).requires_grad_(), make(TOKENS, 1, OUT)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().abs().max() / expected.detach().abs().max())


def _reference(x, weight, lora_a, lora_b, grad, scale=SCALE):
    output = x @ weight.t() + scale * (x @ lora_a.t()) @ lora_b.t()
    return (output, *torch.autograd.grad(output, (x, lora_a, lora_b), grad))


def _fused(x, weight, lora_a, lora_b, grad, *, fuse_dgrad: bool, in_place: bool):
    base_input, hidden = down_projection(x, lora_a, None, 0.0, fuse_dgrad=fuse_dgrad)
    output = add_up_projection(torch.matmul(base_input, weight.t()), hidden, lora_b, SCALE, in_place=in_place)
    return (output, *torch.autograd.grad(output, (x, lora_a, lora_b), grad))


@pytest.mark.parametrize("fuse_dgrad,in_place", [(False, False), (True, False), (False, True), (True, True)])
def test_fused_kernels_match_plain_autograd(fuse_dgrad, in_place):
    inputs = _inputs()
    expected = _reference(*inputs)
    actual = _fused(*inputs, fuse_dgrad=fuse_dgrad, in_place=in_place)
    errors = [_relative(a, e) for a, e in zip(actual, expected)]
    assert max(errors) <= TOLERANCE, errors
    # Negative controls: the unscaled term, and A's grad of another layer (seed 1).
    unscaled = _reference(*inputs, scale=1.0)
    assert _relative(unscaled[0], expected[0]) > 100 * TOLERANCE
    assert _relative(_fused(*_inputs(1), fuse_dgrad=fuse_dgrad, in_place=in_place)[2], expected[2]) > 100 * TOLERANCE


def test_in_place_writes_into_the_fresh_base_output_and_base_input_grad():
    x, weight, lora_a, lora_b, grad = _inputs()
    base_input, hidden = down_projection(x, lora_a, None, 0.0, fuse_dgrad=True)
    base_output = torch.matmul(base_input, weight.t())
    output = add_up_projection(base_output, hidden, lora_b, SCALE, in_place=True)
    assert output.data_ptr() == base_output.data_ptr()  # no output-sized result tensor in forward

    seen = {}
    base_input.register_hook(lambda g: seen.update(base_dgrad=g.data_ptr()))
    (grad_x,) = torch.autograd.grad(output, (x,), grad)
    assert grad_x.data_ptr() == seen["base_dgrad"]  # LoRA dgrad accumulated into the base's, in place


def test_in_place_refused_by_autograd_when_the_base_output_is_saved():
    """`in_place` promises the base output is not saved by its node; if it were, autograd raises."""
    x, _, lora_a, lora_b, grad = _inputs()
    base_output = torch.exp(x @ torch.ones(OUT, IN, dtype=x.dtype).t())  # exp saves its output
    output = add_up_projection(base_output, x @ lora_a.t(), lora_b, SCALE, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(output, (x,), grad)


def test_view_of_a_larger_tensor_is_not_written_in_place():
    x, weight, lora_a, lora_b, grad = _inputs()
    wide = torch.matmul(x, torch.cat([weight, weight]).t())
    base_output = wide[..., :OUT]  # a window into a larger tensor: must stay untouched outside it
    before = wide[..., OUT:].clone()
    output = add_up_projection(base_output, x @ lora_a.t(), lora_b, SCALE, in_place=True)
    assert torch.equal(wide[..., OUT:], before)
    assert output.data_ptr() != base_output.data_ptr()


def test_double_backward_falls_back_out_of_place():
    inputs = [tensor.detach().requires_grad_(tensor.requires_grad) for tensor in _inputs()]
    x, weight, lora_a, lora_b, _ = inputs

    def fused(x_, a_, b_):
        base_input, hidden = down_projection(x_, a_, None, 0.0, fuse_dgrad=True)
        return add_up_projection(torch.matmul(base_input, weight.t()), hidden, b_, SCALE, in_place=True)

    assert torch.autograd.gradgradcheck(fused, (x, lora_a, lora_b))
