"""Sequence-parallel LayerNorm and RMSNorm that need neither apex nor TransformerEngine.

Under sequence parallelism (SP) each tensor-parallel rank normalizes its own slice of
the sequence, so the norm itself is the plain torch op; what SP changes is the
gradient: every TP rank holds a replica of gamma/beta but sees different tokens, so
their gradients must be summed over the TP group. megatron-core does that sum in
`finalize_model_grads` for every parameter marked ``sequence_parallel=True``
(distributed/finalize_model_grads.py, `_allreduce_non_tensor_model_parallel_grads`).
Megatron's own `WrappedTorchNorm` refuses SP outright; this module is that wrapper with
the marking added, so it slots into the same `ModuleSpec` seat.

Zero-centered gamma (Megatron-LM's ``--apply-layernorm-1p``, megatron's ``layernorm_zero_centered_gamma``;
Qwen3-Next's and Qwen3.5's norms): the parameter is stored as w and the norm scales by 1 + w, with w
initialized to 0, so weight decay pulls the gain towards 1 instead of 0 (TransformerEngine's
``zero_centered_gamma``, transformers' ``Qwen3NextRMSNorm``).
"""

import torch
import torch.nn.functional as F

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
        zero_centered = config.layernorm_zero_centered_gamma or zero_centered_gamma
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            norm = (ZeroCenteredLayerNorm if zero_centered else torch.nn.LayerNorm)(
                hidden_size, eps=eps, dtype=config.params_dtype)
        elif kind == "RMSNorm":
            norm = (ZeroCenteredRMSNorm if zero_centered else torch.nn.RMSNorm)(
                hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"--normalization {kind!r} is not supported; use LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose gain is 1 + ``weight`` (``weight`` starts at 0)."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose gain is 1 + ``weight`` (``weight`` starts at 0; the bias is as usual)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)
