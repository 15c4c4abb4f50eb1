"""The expert output projection, in SequentialMLP's ``linear_fc2`` seat: megatron's, with two fixes
for biased experts (GPT-OSS), which megatron's local experts get wrong.

In place: megatron's SequentialMLP adds a biased expert's bias in place, ``output += bias * per_token_scale``
(megatron/core/transformer/mlp.py). The output comes from `reduce_from_tensor_model_parallel_region`,
a custom autograd Function that returns its input as-is (a no-op reduce at one rank, an in-place
all-reduce otherwise), and autograd refuses in-place edits of such a view ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"). TE's grouped experts never
take that path.

Gradient: `RowParallelLinear` tags its bias ``sequence_parallel`` under SP, so `finalize_model_grads`
sums its gradient over the dense TP group, as for a norm that saw only its rank's tokens. An
expert's gradient is already summed over the expert-data-parallel group, which at expert-TP 1
spans the dense TP ranks: the sum doubled the bias gradient at TP2 (measured: GPT-OSS's grad norm
5.46 against CP1's 5.14, every fc2 bias gradient 2x).

Grad norm: the expert optimizer's norm skips parameters megatron thinks are TP duplicates
(`param_is_not_tensor_parallel_duplicate`: untagged, and not on rank 0 of the *dense* TP group,
which megatron hands the expert optimizer too). The expert-TP group is what shards an expert; at
expert-TP 1 the bias is sharded over that one rank like the expert's weights, which are tagged.
Untagged, the biases of experts held on dense-TP rank 1 dropped out of the norm (4.90 against 5.14).
Tagged as the weights are, each expert's bias counts once in its expert-model-parallel group.

Biased experts at expert-TP > 1 are refused at parse time (`cp_ext.arguments.network`: each TP
rank would add the bias to its partial sum).
"""

from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear whose output, when a bias rides beside it, may be added to in place.

    The clone costs one copy of the expert's output, only for biased experts and only where the
    output is such a view."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None and self.is_expert:  # expert-TP 1 here (see the module doc)
            self.bias.sequence_parallel = False  # its gradient is reduced over expert-DP only
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=1)  # in the norm once

    def forward(self, input_):
        output, bias = super().forward(input_)
        if bias is not None and output._is_view():
            output = output.clone()
        return output, bias
