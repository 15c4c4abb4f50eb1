"""The expert output projection, in SequentialMLP's ``linear_fc2`` seat.

megatron's SequentialMLP adds a biased expert's bias in place, ``output += bias * per_token_scale``
(megatron/core/transformer/mlp.py). The output comes from `reduce_from_tensor_model_parallel_region`,
a custom autograd Function that returns its input as-is (a no-op reduce at one rank, an in-place
all-reduce otherwise), and autograd refuses in-place edits of such a view ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"). TE's grouped experts never
take that path, which is why megatron's local experts with biases (GPT-OSS) fail there.
"""

from megatron.core.tensor_parallel import RowParallelLinear


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear whose output, when a bias rides beside it, may be added to in place.

    The clone costs one copy of the expert's output, only for biased experts and only where the
    output is such a view."""

    def forward(self, input_):
        output, bias = super().forward(input_)
        if bias is not None and output._is_view():
            output = output.clone()
        return output, bias
