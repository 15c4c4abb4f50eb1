"""Sequence-parallel LayerNorm and RMSNorm that need neither apex nor TransformerEngine.

Under sequence parallelism (SP) each tensor-parallel rank normalizes its own slice of
the sequence, so the norm itself is the plain torch op; what SP changes is the
gradient: every TP rank holds a replica of gamma/beta but sees different tokens, so
their gradients must be summed over the TP group. megatron-core does that sum in
`finalize_model_grads` for every parameter marked ``sequence_parallel=True``
(distributed/finalize_model_grads.py, `_allreduce_non_tensor_model_parallel_grads`).
Megatron's own `WrappedTorchNorm` refuses SP outright; this module is that wrapper with
the marking added, so it slots into the same `ModuleSpec` seat.
"""

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelNorm:
    """Factory with the signature megatron's layer specs call norms with.

    Returns a `torch.nn.LayerNorm` or `torch.nn.RMSNorm` (by ``config.normalization``)
    whose parameters carry ``sequence_parallel = config.sequence_parallel``.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # accepted for spec compatibility; no fused kernel
        zero_centered_gamma: bool = False,
        normalization: str = None,
    ):
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("cp_ext norms do not implement zero-centered gamma; unset it")
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"--normalization {kind!r} is not supported; use LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
