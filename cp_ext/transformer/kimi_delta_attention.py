"""Kimi Delta Attention (KDA, Kimi-Linear's linear-attention mixer) as a megatron-core module, with the parameter
names of Megatron-LM's ``KimiDeltaAttention`` (``megatron/core/ssm/gated_delta_net/kda.py``, its low-rank layout),
exact under context parallelism by state passing (`cp_ext.linear_attention`, as `cp_ext.transformer.
gated_delta_net` does).

KDA is Gated DeltaNet with a decay per key channel instead of per head (`cp_ext.linear_attention.kda`), its own
projections and a sigmoid output gate. Numerically transformers 5.25's ``KimiLinearDeltaAttention``. H heads
(query, key and value alike: no grouped value heads), key head dim K, value head dim V, per TP rank H / TP heads:

==================  ==================================================================================
``in_proj.weight``   [(2 H K + H V) / TP, hidden]: megatron's `ColumnParallelLinear`; each TP rank's rows its
                     own [q | k | v] (its heads of each, in order). The checkpoint holds the sections as
                     ``in_proj.weight.query / key / value``, each TP-sharded (Megatron-LM's split names).
                     transformers: ``q_proj``, ``k_proj``, ``v_proj``.
``conv1d.weight``    [(2 H K + H V) / TP, 1, w]: the depthwise causal conv over this rank's [q | k | v] with
                     SiLU (no bias); checkpoint sections query / key / value.
``f_a_proj.weight``  [r_f, hidden], replicated over TP; ``f_b_proj.weight`` [H K / TP, r_f]
                     (`ColumnParallelLinear`): the low-rank forget-gate input f (transformers:
                     ``forget_gate.f_a_proj`` / ``f_b_proj``; r_f = K, as Kimi-Linear).
``dt_bias``          [H K / TP]; ``A_log`` [H / TP]: g = -exp(A_log_h) softplus(f + dt_bias), one log-decay per
                     head and key channel, in fp32 (transformers: ``forget_gate.dt_bias``, ``forget_gate.A_log``
                     of shape [1, 1, H, 1]).
``beta_proj.weight`` [H / TP, hidden] (`ColumnParallelLinear`): beta = sigmoid(beta_proj(x)) (transformers:
                     ``b_proj``; Megatron-LM keeps it replicated, the same global tensor).
``g_a_proj.weight``  [r_g, hidden], replicated; ``g_b_proj.weight`` [H V / TP, r_g]: the output gate (r_g = V).
``out_norm.weight``  [V], replicated: RMSNorm over each head times sigmoid(gate), fp32 (transformers'
                     ``KimiLinearRMSNormGated``, ``o_norm``); 1 + weight under ``layernorm_zero_centered_gamma``.
``out_proj.weight``  [hidden, H V / TP]: megatron's `RowParallelLinear` (transformers: ``o_proj``).
==================  ==================================================================================

The replicated low-rank down projections read this rank's input: under sequence parallelism its sequence shard
(their weights are marked ``sequence_parallel``, so megatron's ``finalize_model_grads`` sums their gradients over
TP, as a norm's), without it the whole sequence, where the up projection's input copy already sums every rank's
heads into the gradient.

Forward, on megatron's [s, b, hidden] (this rank's CP shard in cp_ext's layout; the SP shard under
``config.sequence_parallel``): in_proj -> the causal conv of [q | k | v] with SiLU (its halo from the CP ranks
before, `context_parallel_causal_conv1d`) -> the per-channel gated delta rule with q and k L2-normalized in the
rule (`context_parallel_gated_delta` over this layer's CP group; the plain rule at CP = 1) -> the sigmoid-gated
RMSNorm -> out_proj. Returns (output, None). This module owns the parameters and the projections (`_project`,
`_decay`, `_gate`); the conv and the rule on every CP path (the ring, Ulysses, dynamic CP, CP-aware recompute,
generation), packed documents and the checkpoint map are `cp_ext.transformer.linear_mixer.LinearMixer`'s, as
Gated DeltaNet's.

transformers' names <-> these (the Hugging Face import's map and the layer tests'): `cp_ext.hf.kda_layout`.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from cp_ext.transformer.gated_delta_net import GatedRMSNorm
from cp_ext.transformer.linear_mixer import LinearMixer

SIZE_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads")


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """RMSNorm over the last dim times sigmoid(gate): KDA's ``out_norm`` (transformers' ``KimiLinearRMSNormGated``,
    Megatron-LM's KDA ``_apply_gated_norm``), fp32 inside, the result in x's dtype."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = weight.to(acc) + 1 if self.zero_centered_gamma else weight.to(acc)
        return (normed * gain * torch.sigmoid(gate.to(acc))).to(x.dtype)


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T with W [out, in] whole on every TP rank (Megatron-LM's ``parallel_mode="duplicated"``); returns
    (y, None) as megatron's linear layers. ``sequence_parallel``: the input is this rank's sequence shard, so the
    weight's gradient is partial and megatron's ``finalize_model_grads`` sums it over TP."""

    def __init__(self, in_features: int, out_features: int, config: TransformerConfig, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=config.params_dtype,
                                                     device=device))
        if config.perform_initialization:
            config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.linear(x, self.weight), None


def _check(config, sizes):
    tp = config.tensor_model_parallel_size
    flags = {field: "--" + field.replace("_", "-") for field in SIZE_FIELDS}
    problems = [f"{flags[f]} must be a positive integer, got {v!r}" for f, v in sizes.items()
                if not isinstance(v, int) or v < 1]
    if problems:
        raise ValueError("; ".join(problems))
    if sizes["linear_num_key_heads"] != sizes["linear_num_value_heads"]:
        problems.append(f"Kimi Delta Attention has no grouped value heads: --linear-num-value-heads "
                        f"({sizes['linear_num_value_heads']}) must equal --linear-num-key-heads "
                        f"({sizes['linear_num_key_heads']})")
    elif sizes["linear_num_key_heads"] % tp:
        problems.append(f"--linear-num-key-heads ({sizes['linear_num_key_heads']}) must be divisible by "
                        f"--tensor-model-parallel-size ({tp})")
    if problems:
        raise ValueError("; ".join(problems))


class KimiDeltaAttention(LinearMixer):
    """Kimi-Linear's KDA mixer with Megatron-LM's KDA parameter names (see the module docstring)."""

    IN_PROJ_NAMES = ("query", "key", "value")  # Megatron-LM's checkpoint sections

    def __init__(self, config: TransformerConfig, *, linear_conv_kernel_dim: Optional[int] = None,
                 linear_key_head_dim: Optional[int] = None, linear_value_head_dim: Optional[int] = None,
                 linear_num_key_heads: Optional[int] = None, linear_num_value_heads: Optional[int] = None,
                 f_lora_rank: Optional[int] = None, gate_lora_rank: Optional[int] = None,
                 layer_number: int = 1, **spec_kwargs):
        """Sizes not given are the config's fields of the same names (value heads must equal key heads); the
        low-rank gate ranks default to the key (forget gate) and value (output gate) head dims, as
        Kimi-Linear. ``spec_kwargs``: what megatron's TransformerLayer passes its self-attention, unused."""
        super().__init__(config=config)
        given = dict(linear_conv_kernel_dim=linear_conv_kernel_dim, linear_key_head_dim=linear_key_head_dim,
                     linear_value_head_dim=linear_value_head_dim, linear_num_key_heads=linear_num_key_heads,
                     linear_num_value_heads=linear_num_value_heads)
        sizes = {f: getattr(config, f) if v is None else v for f, v in given.items()}
        _check(config, sizes)
        tp = config.tensor_model_parallel_size
        self.layer_number = layer_number
        self.conv_kernel_dim = sizes["linear_conv_kernel_dim"]
        self.key_head_dim, self.value_head_dim = sizes["linear_key_head_dim"], sizes["linear_value_head_dim"]
        self.num_heads = sizes["linear_num_key_heads"]
        self.heads_local = self.num_heads // tp
        self.qk_dim_local = self.heads_local * self.key_head_dim
        self.v_dim_local = self.heads_local * self.value_head_dim
        self.in_proj_split_sections = (self.qk_dim_local, self.qk_dim_local, self.v_dim_local)
        self.key_heads_local = self.value_heads_local = self.heads_local  # no grouped value heads
        self.f_lora_rank = f_lora_rank or self.key_head_dim
        self.gate_lora_rank = gate_lora_rank or self.value_head_dim
        qk_dim, v_dim = self.num_heads * self.key_head_dim, self.num_heads * self.value_head_dim
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()

        def column(inputs, outputs, buffer):
            return tensor_parallel.ColumnParallelLinear(
                inputs, outputs, config=config, init_method=config.init_method, gather_output=False, bias=False,
                skip_bias_add=False, is_expert=False, tp_comm_buffer_name=buffer)

        self.in_proj = column(config.hidden_size, 2 * qk_dim + v_dim, "qkv")
        conv_dim_local = 2 * self.qk_dim_local + self.v_dim_local
        self.conv1d = torch.nn.Conv1d(conv_dim_local, conv_dim_local, kernel_size=self.conv_kernel_dim,
                                      groups=conv_dim_local, padding=self.conv_kernel_dim - 1, bias=False,
                                      device=device, dtype=config.params_dtype)
        self.f_a_proj = ReplicatedLinear(config.hidden_size, self.f_lora_rank, config, device)
        self.f_b_proj = column(self.f_lora_rank, qk_dim, "f_b_proj")
        self.beta_proj = column(config.hidden_size, self.num_heads, "beta_proj")
        self.g_a_proj = ReplicatedLinear(config.hidden_size, self.gate_lora_rank, config, device)
        self.g_b_proj = column(self.gate_lora_rank, v_dim, "g_b_proj")
        self.dt_bias = torch.nn.Parameter(torch.zeros(self.qk_dim_local, dtype=config.params_dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads_local, dtype=config.params_dtype, device=device))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):  # split over TP along dim 0
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = SigmoidGatedRMSNorm(self.value_head_dim, config.layernorm_epsilon,
                                            zero_centered_gamma=config.layernorm_zero_centered_gamma,
                                            dtype=config.params_dtype, device=device)
        self.out_proj = tensor_parallel.RowParallelLinear(
            v_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="out_proj")
        if config.perform_initialization:  # FLA's (and Megatron-LM's): A uniform in [1, 16], dt log-uniform
            with tensor_parallel.get_cuda_rng_tracker().fork():
                self.A_log.data.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
                self.dt_bias.data.copy_(dt_bias_init(torch.rand_like(self.dt_bias)))
        self._init_state()

    def _project(self, hidden_states):
        qkv, _ = self.in_proj(hidden_states)  # [s, b, this TP rank's q | k | v]

        def low_rank(down, up):  # [s_sp, b, hidden] -> [b, s, this rank's heads x dim]
            return up(down(hidden_states)[0])[0].transpose(0, 1)

        beta_logit = self.beta_proj(hidden_states)[0].transpose(0, 1)  # [b, s, h]
        return qkv.transpose(0, 1), (low_rank(self.f_a_proj, self.f_b_proj), beta_logit), \
            low_rank(self.g_a_proj, self.g_b_proj)

    def _decay(self, f, beta_logit):
        """g = -exp(A_log_h) softplus(f + dt_bias) per head and key channel (fp32, as transformers), beta."""
        acc = torch.float64 if f.dtype == torch.float64 else torch.float32
        g = -self.A_log.to(acc).exp()[:, None] * F.softplus(
            (f.to(acc) + self.dt_bias.to(acc)).unflatten(-1, (self.heads_local, self.key_head_dim)))
        return g, beta_logit.sigmoid()

    def _gate(self, gate):
        return gate.unflatten(-1, (self.heads_local, self.value_head_dim))


def dt_bias_init(uniform: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
    """FLA's (and transformers', Megatron-LM's) KDA ``dt_bias`` from U(0, 1) draws: dt log-uniform in
    [dt_min, dt_max], at least ``floor``, stored as softplus^-1(dt) so that softplus(dt_bias) = dt at f = 0."""
    dt = (uniform * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).exp().clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))

