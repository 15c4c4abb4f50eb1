"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): n residual streams per token instead of one.

Between layers each token carries ``n`` streams of ``hidden`` values. Around each block (attention, then the MLP)
a `HyperConnection` reads the token's streams (an unweighted RMSNorm of all ``n * hidden`` values, one linear map,
fp32) and makes three mixings::

    pre  = sigmoid(w_pre * s_0 + b_pre) + eps                          [n]     the block's input: sum_j pre_j x_j
    post = 2 sigmoid(w_post * s_1 + b_post)                            [n]     where the block's output goes
    comb = Sinkhorn(softmax(w_comb * s_2 + b_comb) + eps)              [n, n]  doubly stochastic
    x'_k = post_k * block(sum_j pre_j x_j) + sum_j comb_jk x_j

(``iterations`` Sinkhorn normalizations, columns first). The first layer copies the embedding into every stream;
after the last layer a `HyperHead` collapses them (``sum_j pre_j x_j`` with its own weights) before the final norm.
With MTP the streams go on to the MTP layers (each reads them per stream and ends in its own head and norm), and
the model collapses the decoder's streams after them (`StreamsFinalNorm`, `collapse`).
This is transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` / ``DeepseekV4DecoderLayer``.

Everything is per token, so context parallelism needs nothing: each rank mixes its own tokens' streams. Between
layers (and pipeline stages) the streams travel as megatron's ``[s * n, b, hidden]`` tensor, token-major (token
i's streams are rows ``i n .. i n + n - 1``), so a sequence-parallel split still cuts between tokens and the
pipeline sends ``n`` times megatron's sequence (`pipeline_seq_length`). The mixing weights are whole on every TP
rank; under sequence parallelism each rank mixes its share of the tokens, so they are marked ``sequence_parallel``
(megatron's finalize_model_grads sums their gradients over TP).
"""

import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer

from cp_ext.attention.compressed import rms_norm
from cp_ext.megatron_compat import model_layer_number

EPS = 1e-6  # transformers' hc_eps (DeepSeek-V4's)


def pipeline_seq_length(args) -> int:
    """The sequence length megatron's pipeline sends between stages: ``n`` rows per token with hyper-connections."""
    return args.seq_length * (args.num_residual_streams if getattr(args, "enable_hyper_connections", False) else 1)


class _Mixing(MegatronModule):
    """``mix_weight`` [outputs, n * hidden], ``mix_bias`` [outputs], ``mix_scale`` [scales]: fp32, whole on every
    TP rank, summed over TP under sequence parallelism."""

    def __init__(self, config, outputs: int, scales: int):
        super().__init__(config=config)
        n = config.num_residual_streams
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.streams = n
        self.mix_weight = torch.nn.Parameter(torch.empty(outputs, n * config.hidden_size, device=device))
        torch.nn.init.normal_(self.mix_weight, std=config.init_method_std)
        self.mix_bias = torch.nn.Parameter(torch.zeros(outputs, device=device))
        self.mix_scale = torch.nn.Parameter(torch.ones(scales, device=device))
        for p in (self.mix_weight, self.mix_bias, self.mix_scale):
            p.sequence_parallel = config.sequence_parallel

    def _mixes(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [..., n, hidden] -> the linear map of the normed, flattened streams, fp32 (fp64 for fp64)."""
        acc = torch.float64 if streams.dtype == torch.float64 else torch.float32
        flat = rms_norm(streams.flatten(-2).to(acc), None, self.config.layernorm_epsilon)  # unweighted
        return flat @ self.mix_weight.to(acc).t()


class HyperConnection(_Mixing):
    """One block's pre / post / comb mixing of the streams (module docstring)."""

    def __init__(self, config):
        n = config.num_residual_streams
        super().__init__(config, (2 + n) * n, 3)
        self.iterations = config.mhc_sinkhorn_iterations

    def forward(self, streams: torch.Tensor):
        """streams [..., n, hidden] -> (post [..., n], comb [..., n, n], the block's input [..., hidden])."""
        n = self.streams
        mixes = self._mixes(streams)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.mix_bias.to(mixes.dtype).split([n, n, n * n])
        scale = self.mix_scale.to(mixes.dtype)
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + EPS
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + EPS
        comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + EPS)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


def collapse(streams: torch.Tensor, head: "HyperHead", norm) -> torch.Tensor:
    """Token-major streams [s * n, b, hidden] -> ``norm(head(streams))`` [s, b, hidden]: the model's output (or an
    MTP layer's) where the streams went on past the last layer (`StreamsFinalNorm`)."""
    streams = streams.unflatten(0, (-1, head.streams)).transpose(1, 2)  # [s, b, n, hidden]
    return norm.normalize(head(streams))


class StreamsFinalNorm(torch.nn.Module):
    """The final norm's seat (the decoder's, an MTP layer's) under hyper-connections with MTP: its parameters, by
    the usual names, but ``forward`` hands the streams on unchanged, because the MTP layers read the streams before
    the head collapses them (DeepSeek-V4's MTP: ``h_proj(hnorm(x))`` per stream); `normalize` is the norm, which
    `collapse` applies after the head. RMSNorm or LayerNorm (``config.normalization``), as `SequenceParallelNorm`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.layernorm, self.eps, self.hidden_size = config.normalization == "LayerNorm", eps, hidden_size
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 0.0 if self.zero_centered else 1.0,
                                                    dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)) if self.layernorm else None
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.layernorm:
            return torch.nn.functional.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
        return torch.nn.functional.rms_norm(x, (self.hidden_size,), weight, self.eps)


def mix_back(streams, block_output, post, comb):
    """x'_k = post_k * output + sum_j comb_jk x_j (in the streams' dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                      streams)


class HyperHead(_Mixing):
    """The final collapse of the streams (transformers' ``DeepseekV4HyperHead``)."""

    def __init__(self, config):
        super().__init__(config, config.num_residual_streams, 1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = self._mixes(streams)
        pre = torch.sigmoid(mixes * self.mix_scale.to(mixes.dtype) + self.mix_bias.to(mixes.dtype)) + EPS
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


class HyperConnectionTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with its two residual adds replaced by the mHC mixings (module docstring):
    the same submodules (norms, attention, MLP or MoE), ``attn_hc`` and ``ffn_hc`` around them, and on the
    model's last layer the ``hc_head``. No bias-dropout-add: V4 has neither biases nor hidden dropout."""

    def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        number = model_layer_number(self)  # an MTP layer's: after the decoder's, on every megatron-core
        self.is_first = number == 1
        self.is_last = number == config.num_layers
        self.hc_head = HyperHead(config) if self.is_last else None
        # with MTP the streams go on to the MTP layers: the model collapses them with this head afterwards
        self.collapses = self.is_last and not config.mtp_num_layers

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, padding_mask=None, **kwargs):
        n = self.config.num_residual_streams
        if self.is_first:  # the embedding, copied into every stream
            streams = hidden_states.unsqueeze(1).expand(-1, n, -1, -1)
        else:
            streams = hidden_states.unflatten(0, (-1, n))
        streams = streams.transpose(1, 2)  # [s, b, n, hidden]
        post, comb, collapsed = self.attn_hc(streams)
        attention, bias = self.self_attention(
            self.input_layernorm(collapsed), attention_mask=attention_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
        streams = mix_back(streams, attention if bias is None else attention + bias, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp_input = self.pre_mlp_layernorm(collapsed)
        mlp, bias = self.mlp(mlp_input) if padding_mask is None else self.mlp(mlp_input, padding_mask=padding_mask)
        streams = mix_back(streams, mlp if bias is None else mlp + bias, post, comb)
        if self.collapses:
            return self.hc_head(streams), context
        return streams.transpose(1, 2).flatten(0, 1), context
