"""The expert projections, in SequentialMLP's ``linear_fc1`` / ``linear_fc2`` seats: megatron's, with the
fixes biased experts (GPT-OSS) and expert-TP != TP need, which megatron-core's local experts get wrong.

In place: megatron's SequentialMLP adds a biased expert's bias in place, ``output += bias * per_token_scale``
(megatron/core/transformer/mlp.py). The output comes from `reduce_from_tensor_model_parallel_region`,
a custom autograd Function that returns its input as-is (a no-op reduce at one rank, an in-place
all-reduce otherwise), and autograd refuses in-place edits of such a view ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"). TE's grouped experts never
take that path.

Added once: at expert-TP > 1 an expert's ``linear_fc2`` returns its rank's partial sum, which the token
dispatcher's combine adds up over the expert-TP ranks (``explicit_expert_comm``), and megatron adds the
bias to every partial: expert-TP times the bias in the output. Here only expert-TP rank 0 adds it; every
rank still gets the bias's whole gradient (each receives the whole output gradient in the combine's
backward), so the replicas stay equal without a reduction over expert-TP.

Gradient reduction: `RowParallelLinear` tags its bias ``sequence_parallel`` under SP, so
`finalize_model_grads` sums its gradient over the dense TP group, as for a norm that saw only its rank's
tokens. An expert's gradient is already summed over the expert-data-parallel group, which at expert-TP 1
spans the dense TP ranks, and at expert-TP = TP every rank has the whole gradient: either way that sum
doubles it at TP2 (measured: GPT-OSS's grad norm 5.46 against CP1's 5.14, every fc2 bias gradient 2x).
The bias is untagged here.

Expert-TP != TP at EP 1: the experts' weights must be reduced over megatron's expert-data-parallel group
(at expert-TP 1 under TP 2 it holds the TP peers, whose tokens the replicated experts also saw).
megatron-core 0.16.1 marks them for it (``allreduce=False``) only under EP > 1, so DDP reduced them over
data parallelism only (measured at TP2, expert-TP 1: expert gradients 0.4x the single-process ones);
0.17 and later mark them whenever expert-TP != TP as well (``use_expert_pgs``). Both seats here mark them
that way on every release.

Grad norm: the expert optimizer's norm skips parameters megatron thinks are TP duplicates
(`param_is_not_tensor_parallel_duplicate`: untagged, and not rank 0 of the dense TP group, which
megatron-core 0.16.1 hands the expert optimizer too). The fc2 bias is one tensor per expert, whole on
each expert-TP rank: tagged as parallel on expert-TP rank 0 only, it counts once per expert wherever that
expert lives (at expert-TP 1, the one rank; untagged, the biases of experts held on dense-TP rank 1
dropped out of the norm: 4.90 against 5.14).
"""

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


def _reduce_over_expert_data_parallel(layer) -> None:
    """megatron-core 0.17+'s rule on every release: an expert's parameters are reduced over the expert-data-
    parallel group (``allreduce=False``) under EP > 1 or expert-TP != TP."""
    config = layer.config
    if layer.is_expert and config.expert_tensor_parallel_size != config.tensor_model_parallel_size:
        for param in (layer.weight, layer.bias):
            if param is not None:
                param.allreduce = False


class _AddedOnce(torch.autograd.Function):
    """The bias this expert-TP rank adds to its partial sum: all of it on rank 0, zeros elsewhere; its
    gradient is the whole incoming gradient on every rank."""

    @staticmethod
    def forward(ctx, bias, first):
        return bias.clone() if first else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ExpertColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear whose expert parameters are reduced as megatron-core 0.17+ does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _reduce_over_expert_data_parallel(self)


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear for experts: the bias added once over expert-TP, in place where megatron
    adds it, reduced and normed once (module doc).

    The clone costs one copy of the expert's output, only for biased experts and only where the
    output is such a view."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _reduce_over_expert_data_parallel(self)
        self.expert_tp = self.tp_group.size() if self.is_expert else 1
        if self.bias is not None and self.is_expert:
            self.bias.sequence_parallel = False  # its gradient is whole on every rank already
            # counted in the grad norm once: on expert-TP rank 0 (the only one at expert-TP 1)
            set_tensor_model_parallel_attributes(self.bias, is_parallel=self.tp_group.rank() == 0, dim=0, stride=1)

    def forward(self, input_):
        output, bias = super().forward(input_)
        if bias is not None and self.expert_tp > 1:
            bias = _AddedOnce.apply(bias, self.tp_group.rank() == 0)
        if bias is not None and output._is_view():
            output = output.clone()
        return output, bias
