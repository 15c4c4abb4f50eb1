"""Gated DeltaNet (Qwen3-Next's linear-attention mixer) as a megatron-core module, in megatron-core 0.19's
parameter layout, exact under context parallelism by state passing (`cp_ext.linear_attention`).

The parameters carry megatron-core 0.19's names and shapes (``megatron/core/ssm/gated_delta_net``), so a state
dict moves between this module and megatron's ``GatedDeltaNet`` by name, per TP rank:

=================  ===================================================================================
``in_proj.weight``  [(2 H_k K + 2 H_v V + 2 H_v) / TP, hidden]: megatron's `ColumnParallelLinear`. Each TP
                    rank's rows are its own [q | k | v | z | b | a] (its H_k / TP key heads' q and k, its
                    H_v / TP value heads' v, z, beta logit b and decay input a), heads in order: at TP = 1
                    the whole [q | k | v | z | b | a]; at TP = t, rank r holds rows r/t of each section,
                    concatenated (megatron's ``in_proj_split_sections``, which its distributed checkpoint
                    saves as separate query/key/value/z/beta/alpha tensors).
``conv1d.weight``   [(2 H_k K + H_v V) / TP, 1, w]: the depthwise causal conv over this rank's [q | k | v]
                    channels (kernel ``linear_conv_kernel_dim``, no bias, as megatron's default).
``dt_bias``         [H_v / TP]; ``A_log`` [H_v / TP]: g = -exp(A_log) * softplus(a + dt_bias).
``out_norm.weight`` [V]: the gated RMSNorm over each value head, replicated over TP. Its gain is the weight
                    itself (transformers' ``Qwen3NextRMSNormGated``, megatron's norm without zero-centered
                    gamma); with ``config.layernorm_zero_centered_gamma`` it is 1 + weight, as megatron's
                    TENorm built from that config reads it.
``out_proj.weight`` [hidden, H_v V / TP]: megatron's `RowParallelLinear` (input parallel).
=================  ===================================================================================

There is no input layer norm here: megatron's TE spec fuses the layer's pre-norm into ``in_proj``
(``in_proj.layer_norm_weight``); with the local linear layers it is the layer's ``input_layernorm``.

Forward, on megatron's [s, b, hidden] (this rank's CP shard in cp_ext's layout; the sequence-parallel shard
under ``config.sequence_parallel``, which megatron's linear layers gather and reduce-scatter): in_proj ->
the causal conv of [q | k | v] with SiLU -> q, k L2-normalized in the rule -> g and beta = sigmoid(b) -> the
gated delta rule -> the gated RMSNorm with SiLU(z) -> out_proj. Returns (output, bias) as megatron's attention
modules do. This module owns the parameters and the projections (`_project`, `_decay`, `_gate`); the conv and
the rule on every CP path (the ring, Ulysses, dynamic CP, CP-aware recompute, generation), packed documents and
the checkpoint map are `cp_ext.transformer.linear_mixer.LinearMixer`'s, shared with Kimi Delta Attention.

megatron's GDN applies ``config.activation_func`` in the conv and the output gate (SiLU for Qwen3-Next's
SwiGLU configs); this module applies SiLU whatever the config's MLP activation is. The sizes are the config's
(megatron's ``linear_*`` fields, on 0.16.1 through 0.19.x), or keyword arguments of the same names.

Checkpoints: `sharded_state_dict` is megatron's GDN's, so a distributed checkpoint reshards over TP and holds
``in_proj.weight`` as its query / key / value / z / beta / alpha parts and ``conv1d.weight`` as query / key /
value, each TP-sharded on its own (the same keys megatron's module writes).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from cp_ext.transformer.linear_mixer import LinearMixer


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim times SiLU(gate): megatron's GDN ``out_norm`` followed by its output gate.

    The norm runs in fp32 (fp64 for fp64 inputs), the gain is ``weight`` (1 + ``weight`` when zero-centered),
    and the result returns in x's dtype (transformers' ``Qwen3NextRMSNormGated``, megatron's
    ``_apply_gated_norm``)."""

    def __init__(self, hidden_size: int, eps: float, zero_centered_gamma: bool = False, dtype=None, device=None):
        super().__init__()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight  # the TP-reducing view of the weight (see the caller)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = weight.to(acc) + 1 if self.zero_centered_gamma else weight.to(acc)
        return (normed * gain * F.silu(gate.to(acc))).to(x.dtype)


def _check(config, kernel, key_dim, value_dim, key_heads, value_heads):
    tp = config.tensor_model_parallel_size
    problems = []
    for flag, value in (("--linear-conv-kernel-dim", kernel), ("--linear-key-head-dim", key_dim),
                        ("--linear-value-head-dim", value_dim), ("--linear-num-key-heads", key_heads),
                        ("--linear-num-value-heads", value_heads)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{flag} must be a positive integer, got {value!r}")
    if problems:
        raise ValueError("; ".join(problems))
    for flag, heads in (("--linear-num-key-heads", key_heads), ("--linear-num-value-heads", value_heads)):
        if heads % tp:
            problems.append(f"{flag} ({heads}) must be divisible by --tensor-model-parallel-size ({tp})")
    if value_heads % key_heads:
        problems.append(f"--linear-num-value-heads ({value_heads}) must be a multiple of --linear-num-key-heads "
                        f"({key_heads}): each key head serves a group of value heads")
    if problems:
        raise ValueError("; ".join(problems))


class GatedDeltaNet(LinearMixer):
    """Qwen3-Next's Gated DeltaNet mixer with megatron-core 0.19's parameters (see the module docstring)."""

    IN_PROJ_NAMES = ("query", "key", "value", "z", "beta", "alpha")  # megatron's checkpoint sections

    def __init__(self, config: TransformerConfig, *, linear_conv_kernel_dim: Optional[int] = None,
                 linear_key_head_dim: Optional[int] = None, linear_value_head_dim: Optional[int] = None,
                 linear_num_key_heads: Optional[int] = None, linear_num_value_heads: Optional[int] = None,
                 layer_number: int = 1, **spec_kwargs):
        """Sizes not given are the config's fields of the same names; ``spec_kwargs``: what megatron's
        TransformerLayer passes its self-attention (``cp_comm_type``, ``pg_collection``, ``name``), unused."""
        super().__init__(config=config)
        def given_or_config(value, field):
            return getattr(config, field) if value is None else value

        linear_conv_kernel_dim = given_or_config(linear_conv_kernel_dim, "linear_conv_kernel_dim")
        linear_key_head_dim = given_or_config(linear_key_head_dim, "linear_key_head_dim")
        linear_value_head_dim = given_or_config(linear_value_head_dim, "linear_value_head_dim")
        linear_num_key_heads = given_or_config(linear_num_key_heads, "linear_num_key_heads")
        linear_num_value_heads = given_or_config(linear_num_value_heads, "linear_num_value_heads")
        _check(config, linear_conv_kernel_dim, linear_key_head_dim, linear_value_head_dim, linear_num_key_heads,
               linear_num_value_heads)
        tp = config.tensor_model_parallel_size
        self.layer_number = layer_number
        self.conv_kernel_dim = linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = linear_key_head_dim, linear_value_head_dim
        self.num_key_heads, self.num_value_heads = linear_num_key_heads, linear_num_value_heads
        self.key_heads_local, self.value_heads_local = linear_num_key_heads // tp, linear_num_value_heads // tp
        qk_dim, v_dim = linear_key_head_dim * linear_num_key_heads, linear_value_head_dim * linear_num_value_heads
        self.qk_dim_local, self.v_dim_local = qk_dim // tp, v_dim // tp
        # megatron's in_proj_split_sections: this TP rank's [q | k | v | z | b | a]
        self.in_proj_split_sections = (self.qk_dim_local, self.qk_dim_local, self.v_dim_local, self.v_dim_local,
                                       self.value_heads_local, self.value_heads_local)
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, 2 * qk_dim + 2 * v_dim + 2 * linear_num_value_heads, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        conv_dim_local = 2 * self.qk_dim_local + self.v_dim_local
        self.conv1d = torch.nn.Conv1d(conv_dim_local, conv_dim_local, kernel_size=linear_conv_kernel_dim,
                                      groups=conv_dim_local, padding=linear_conv_kernel_dim - 1, bias=False,
                                      device=device, dtype=config.params_dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads_local, dtype=config.params_dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads_local, dtype=config.params_dtype, device=device))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):  # split over TP along dim 0, as megatron's
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = GatedRMSNorm(linear_value_head_dim, config.layernorm_epsilon,
                                     zero_centered_gamma=config.layernorm_zero_centered_gamma,
                                     dtype=config.params_dtype, device=device)
        self.out_proj = tensor_parallel.RowParallelLinear(
            v_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2")
        self._init_state()
        if config.perform_initialization:  # megatron's: dt_bias 1, A uniform in [1, 16] on the TP rank's stream
            with tensor_parallel.get_cuda_rng_tracker().fork():
                self.A_log.data.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())

    def _project(self, hidden_states):
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, this TP rank's sections]
        q, k, v, z, beta_logit, a = torch.split(qkvzba.transpose(0, 1), self.in_proj_split_sections, dim=-1)
        return torch.cat([q, k, v], dim=-1), (a, beta_logit), z

    def _decay(self, a, beta_logit):
        """g = -exp(A_log) softplus(a + dt_bias) per value head (fp32, as megatron) and beta = sigmoid(b)."""
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        return -self.A_log.to(acc).exp() * F.softplus(a.to(acc) + self.dt_bias.to(acc)), beta_logit.sigmoid()

    def _gate(self, z):
        return z.unflatten(-1, (self.value_heads_local, self.value_head_dim))
