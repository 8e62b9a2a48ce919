"""Layout-invariant mode: the same bits on any TP x DP x PP layout (docs/architecture.md section 7).

One mode with its library: `tensor_parallel` holds the per-layer math that makes tensor parallelism
bit-exact (the TP-invariant mode it grew from); the modules beside it add what data, pipeline and expert
parallelism change:
- `tree`: the canonical reduction tree over global microbatches (lanes, subtree property);
- `lanes` (hooks) and `buffer_lanes`: per-microbatch adapter grads summed into lanes instead of
  Megatron's running `main_grad`, and the DP all-gather of lane partials that replaces DDP's all-reduce;
- `experts` and `expert_lanes`: MoE experts on fixed-size token chunks per global microbatch (its
  sequence shards joined), and the all-lane combine of expert-parallel buffers;
- `losses`: the reported loss reduced over global microbatches in one fixed order;
- `checks`: the one-line refusals of what the mode does not cover;
- (`megatron_lora_patch.patches.layout_invariant` holds what the `layout_invariant` patch installs on Megatron-Core.)
"""

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported


class LayoutInvariantUnsupported(TPInvariantUnsupported):
    """The layout-invariant mode cannot run this configuration bit-exactly; the message says what to change."""
