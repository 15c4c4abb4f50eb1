"""Linear attention under context parallelism: the gated delta rule by exact state passing, with Gated
DeltaNet's per-head decay (Qwen3-Next) or Kimi Delta Attention's per-channel one (Kimi-Linear): g's shape picks.

`gated_delta` owns the rule on one device (chunked and token-by-token) and a segment's summary; `kda` the
chunked form's per-channel decay terms; `state_passing` the CP op (segments' summaries all-gathered and
folded in sequence order, or with `ring_exchange` the state passed point to point along the sequence);
`head_parallel` megatron-core's method (all-to-all to head shards and back) and the Ulysses x state-passing
hybrid; `context_parallel` the entry point that picks among them; `conv` the causal depthwise convolution
before the rule and its halo across CP ranks; `segments` which segments a CP rank holds and the
differentiable all-gather they share (and `KeptExchanges`, their replay under CP-aware recompute);
`generation_state` a layer's generation cache; `fla_kernels` fla's Triton kernels on CUDA. The layers that use
them are `cp_ext.transformer.linear_mixer`'s.
"""

from cp_ext.linear_attention.context_parallel import METHODS, context_parallel_linear_attention
from cp_ext.linear_attention.conv import causal_conv1d, context_parallel_causal_conv1d, conv_halo
from cp_ext.linear_attention.gated_delta import (SegmentSummary, document_resets, gated_delta_recurrent,
                                                 gated_delta_rule, l2norm, segment_summary)
from cp_ext.linear_attention.head_parallel import check_head_parallel, head_parallel_gated_delta, ulysses_state_passing
from cp_ext.linear_attention.ring_exchange import ring_states
from cp_ext.linear_attention.state_passing import EXCHANGES, context_parallel_gated_delta, fold_states

__all__ = ["EXCHANGES", "METHODS", "SegmentSummary", "causal_conv1d", "check_head_parallel",
           "context_parallel_causal_conv1d", "context_parallel_gated_delta", "context_parallel_linear_attention",
           "conv_halo", "document_resets", "fold_states", "gated_delta_recurrent", "gated_delta_rule",
           "head_parallel_gated_delta", "l2norm", "ring_states", "segment_summary", "ulysses_state_passing"]
