"""Linear attention under context parallelism: the gated delta rule by exact state passing, with Gated
DeltaNet's per-head decay (Qwen3-Next) or Kimi Delta Attention's per-channel one (Kimi-Linear): g's shape picks.

`gated_delta` owns the rule on one device (chunked and token-by-token) and a segment's summary; `kda` the
chunked form's per-channel decay terms; `state_passing` the CP op (segments' summaries all-gathered and
folded in sequence order); `conv` the causal depthwise convolution before it and its halo across CP ranks;
`segments` which segments a CP rank holds and the differentiable all-gather they share. Not yet wired into
a model or flags.
"""

from cp_ext.linear_attention.conv import causal_conv1d, context_parallel_causal_conv1d, conv_halo
from cp_ext.linear_attention.gated_delta import (SegmentSummary, document_resets, gated_delta_recurrent,
                                                 gated_delta_rule, l2norm, segment_summary)
from cp_ext.linear_attention.state_passing import context_parallel_gated_delta, fold_states

__all__ = ["SegmentSummary", "causal_conv1d", "context_parallel_causal_conv1d", "context_parallel_gated_delta",
           "conv_halo", "document_resets", "fold_states", "gated_delta_recurrent", "gated_delta_rule", "l2norm",
           "segment_summary"]
