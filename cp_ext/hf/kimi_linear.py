"""Kimi-Linear (``KimiLinearForCausalLM``) <-> megatron's KDA hybrid (cp_ext's ``--experimental-attention-variant
kda`` with NoPE multi-latent attention), every tensor and flag explicit. Checked against transformers 5.25's
``modeling_kimi_linear.py`` and megatron-core 0.16.1 / 0.19.

config.json -> flags. The release's config.json (Kimi-Linear-48B-A3B) names some keys as its own modeling code did
(``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``, ``num_expert_group``,
``model_max_length``, ``linear_attn_config``, ``first_k_dense_replace``); transformers 5.25 reads those and writes
them back under the same names (``KimiLinearConfig.attribute_map``), beside its own ``layer_types`` /
``mlp_layer_types`` / ``linear_*``. Both are read, with transformers' precedence and defaults (`config_view`):

* ``layer_types``, else ``linear_attn_config``'s ``kda_layers`` / ``full_attn_layers`` (1-based), else
  transformers' default (softmax attention on layers 4, 8, ... counted from 0) -> ``--linear-attention-freq``: N
  where megatron's rule (layer i linear unless (i + 1) % N == 0) gives the pattern, else the 0/1 list (1: KDA);
* KDA: ``linear_attn_config``'s ``num_heads`` / ``head_dim`` / ``short_conv_kernel_size`` (else ``linear_num_heads``
  / ``linear_head_dim`` / ``linear_conv_kernel_dim``) -> ``--linear-num-key-heads`` = ``--linear-num-value-heads``,
  ``--linear-key-head-dim`` = ``--linear-value-head-dim``, ``--linear-conv-kernel-dim``;
* MLA without positions: ``--multi-latent-attention`` with ``q_lora_rank`` (``null``: a plain q_proj),
  ``kv_lora_rank``, ``qk_nope_head_dim`` (``--qk-head-dim``), ``qk_rope_head_dim`` (``--qk-pos-emb-head-dim``: dims
  that transformers never rotates), ``v_head_dim``; ``--qk-layernorm`` (the latent norms), ``--no-rope-freq 1``
  (every layer NoPE), ``--position-embedding-type none``, ``--rope-type rope`` (the softmax scale
  1/sqrt(qk_nope + qk_rope), no YaRN mscale);
* MoE as DeepSeek-V3's (`cp_ext.hf.deepseek_v3`): sigmoid scores with ``e_score_correction_bias`` for the choice
  (``--moe-router-score-function sigmoid --moe-router-enable-expert-bias``), groups ranked by their top-2 scores,
  the chosen scores renormalized (``moe_renormalize``) and scaled by ``routed_scaling_factor``
  (``--moe-router-topk-scaling-factor``), in fp32 (``--moe-router-dtype fp32``); ``mlp_layer_types`` (else the
  first ``first_k_dense_replace`` layers dense) -> ``--moe-layer-freq``; ``num_shared_experts`` shared experts of
  ``moe_intermediate_size`` as one MLP. config.json names no auxiliary loss: ``--moe-aux-loss-coeff 0``.
* Norms: every Kimi RMSNorm scales by its plain weight (``KimiLinearRMSNorm``, the gated ``KimiLinearRMSNormGated``:
  ones at init, not zero-centered), as megatron's without ``--apply-layernorm-1p``; ``rms_norm_eps`` ->
  ``--norm-epsilon``.

The latent norms' epsilon. transformers builds MLA's ``kv_a_layernorm`` (and ``q_a_layernorm``) with eps 1e-6
whatever ``rms_norm_eps`` says (the release's: 1e-5), and megatron has one ``--norm-epsilon``. An RMSNorm's input
scaled by a moves its epsilon: a c / sqrt(a^2 mean(c^2) + eps) = c / sqrt(mean(c^2) + eps / a^2), and the latent c is
read by nothing but that norm. So the import multiplies the latent rows of ``kv_a_proj_with_mqa`` (the first
``kv_lora_rank``; not the shared key part) and all of ``q_a_proj`` by a = sqrt(rms_norm_eps / 1e-6), in fp64, rounded
once to the checkpoint's dtype, and the export divides them back: megatron's norm with ``rms_norm_eps`` is then
transformers' with 1e-6, exactly but for that rounding. Export gives those rows back bit for bit where the
checkpoint holds more precision than the release (a bf16 release in an fp32 checkpoint, the import's default);
from fp32 (or into a ``--bf16`` checkpoint) they come back within an ulp. With ``rms_norm_eps`` 1e-6 nothing is
scaled.

Tensors (HF -> megatron's units; export is the inverse):

* KDA: `cp_ext.hf.kda_layout` (``q_proj`` / ``k_proj`` / ``v_proj`` and ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``
  as megatron's in_proj and conv1d sections, ``A_log`` [1, 1, H, 1] as [H], the rest renamed);
* MLA: ``q_proj`` (or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``), ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` -> megatron's MLA projections as they are (megatron's per-head
  [nope | rope] and latent [c | k_pe] rows are transformers'; no rows are rotated, so none is permuted);
* MoE: ``block_sparse_moe.gate.weight`` / ``.e_score_correction_bias`` (router, expert_bias), ``experts.E.w1`` /
  ``w3`` / ``w2`` (gate, up, down: megatron's linear_fc1 is [w1; w3]), ``shared_experts.{gate,up,down}_proj``;
  a dense layer's ``mlp.{gate,up,down}_proj`` (the release's names; transformers 5.25 saves them as
  ``block_sparse_moe.{gate,up,down}_proj``, its load-time rename run backwards, and loads either: the import reads
  whichever the checkpoint holds, the export writes the names the import read).

Not imported, by design: an MTP layer (layers from ``num_hidden_layers`` on, ``num_nextn_predict_layers``), which
transformers does not read either.
"""

import math

import torch

from cp_ext.hf.adapter import Adapter, layer_unit
from cp_ext.hf.kda_layout import CHECKPOINT_NAMES, CONVS, PROJECTIONS, SECTIONS, a_log_to_hf, a_log_to_megatron
from cp_ext.hf.reader import HFError

LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
LATENT_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default: kv_a_layernorm's and q_a_layernorm's eps
# transformers' attribute -> the key config.json holds it under (KimiLinearConfig.attribute_map)
ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
           "n_group": "num_expert_group", "num_local_experts": "num_experts",
           "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
# what KimiLinearConfig takes when config.json leaves it out (the sizes have no default here: they are required)
DEFAULTS = {"max_position_embeddings": 1048576, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "n_shared_experts": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "q_lora_rank": None,
            "hidden_act": "silu", "linear_conv_kernel_dim": 4}
LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                    "short_conv_kernel_size": "linear_conv_kernel_dim"}
SELF_ATTENTION = "self_attention."  # megatron's seat of a layer's KDA or MLA


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def config_view(config):
    """config.json as transformers 5.25's KimiLinearConfig reads it: its attribute names, ``linear_attn_config``'s
    sizes over the top-level ``linear_*``, ``layer_types`` and ``mlp_layer_types`` resolved."""
    c = dict(config)
    for attr, key in ALIASES.items():
        if attr not in c and key in c:
            c[attr] = c[key]
    for key, value in DEFAULTS.items():
        c.setdefault(key, value)
    c["tie_word_embeddings"] = False  # KimiLinearForCausalLM ties nothing (transformers 5.25): lm_head is its own
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c.get("num_attention_heads")
    linear = c.get("linear_attn_config") or {}
    for key, attr in LINEAR_ATTN_KEYS.items():
        if key in linear:
            c[attr] = linear[key]
    n = c.get("num_hidden_layers")
    if c.get("layer_types") is None and _is_int(n):
        if "full_attn_layers" in linear and "kda_layers" in linear:  # 1-based, as the release counts
            types = [None] * n
            for kind, layers in ((FULL, linear["full_attn_layers"]), (LINEAR, linear["kda_layers"])):
                for layer in layers:
                    if _is_int(layer) and 1 <= layer <= n:
                        types[layer - 1] = kind
            c["layer_types"] = types
        else:
            c["layer_types"] = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
    if c.get("mlp_layer_types") is None and _is_int(n):
        k = config.get("first_k_dense_replace", 1)
        c["mlp_layer_types"] = [DENSE if _is_int(k) and i < k else SPARSE for i in range(n)]
    return c


class KimiLinear(Adapter):
    def __init__(self, config):
        c = config_view(config)
        super().__init__(c)
        self.given = {k for k in ("layer_types", "mlp_layer_types") if config.get(k) is not None}
        self.types, self.mlp_types = list(c.get("layer_types") or []), list(c.get("mlp_layer_types") or [])
        self.experts = c.get("num_local_experts") or 0
        self.kda = {k: c.get(k) for k in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
        self.q_rank, self.kv_rank = c.get("q_lora_rank"), c.get("kv_lora_rank")
        self.nope, self.rope_dim, self.v = c.get("qk_nope_head_dim"), c.get("qk_rope_head_dim"), c.get("v_head_dim")
        self.mtp_layers = range(c.get("num_hidden_layers") or 0,
                                (c.get("num_hidden_layers") or 0) + (c.get("num_nextn_predict_layers") or 0))

    # ---- config.json -> flags ---------------------------------------------------------------------------------

    def latent_scale(self):
        """a: the latent rows' factor that turns megatron's --norm-epsilon into transformers' 1e-6 (module doc); 1
        for an rms_norm_eps `problems` refuses."""
        eps = self.c["rms_norm_eps"]
        positive = isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0
        return math.sqrt(eps / LATENT_NORM_EPS) if positive else 1.0

    def linear_pattern_flag(self):
        """--linear-attention-freq: N where megatron's rule gives layer_types, else the 0/1 list (1: KDA)."""
        linear = [t == LINEAR for t in self.types]
        for n in range(2, len(linear) + 1):
            if all(w == bool((i + 1) % n) for i, w in enumerate(linear)):
                return n
        return "[" + ",".join(str(int(w)) for w in linear) + "]"

    def rope_flags(self):
        """No positions anywhere: KDA has none and transformers' Kimi MLA rotates nothing."""
        return ["--position-embedding-type", "none"]

    def _group_limited(self):
        return (self.c["n_group"] or 1) > 1 and (self.c["topk_group"] or 1) < self.c["n_group"]

    def flags(self):
        c = self.c
        flags = self.model_flags() + [
            "--num-attention-heads", self.heads, "--multi-latent-attention", "--kv-lora-rank", self.kv_rank,
            "--qk-head-dim", self.nope, "--qk-pos-emb-head-dim", self.rope_dim, "--v-head-dim", self.v,
            "--qk-layernorm", "--rope-type", "rope", "--no-rope-freq", 1,
            "--experimental-attention-variant", "kda", "--linear-attention-freq", self.linear_pattern_flag(),
            "--linear-num-key-heads", self.kda["linear_num_heads"],
            "--linear-num-value-heads", self.kda["linear_num_heads"],
            "--linear-key-head-dim", self.kda["linear_head_dim"],
            "--linear-value-head-dim", self.kda["linear_head_dim"],
            "--linear-conv-kernel-dim", self.kda["linear_conv_kernel_dim"]]
        if self.q_rank:
            flags += ["--q-lora-rank", self.q_rank]
        pattern = [int(t == SPARSE) for t in self.mlp_types]
        if any(pattern):
            flags += ["--num-experts", self.experts, "--moe-ffn-hidden-size", c["moe_intermediate_size"],
                      "--moe-layer-freq", 1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]",
                      "--moe-router-topk", c["num_experts_per_tok"], "--moe-router-score-function", "sigmoid",
                      "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", c["routed_scaling_factor"],
                      "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", 0.0,
                      "--moe-shared-expert-intermediate-size", c["moe_intermediate_size"] * c["n_shared_experts"]]
            if self._group_limited():
                flags += ["--moe-router-num-groups", c["n_group"], "--moe-router-group-topk", c["topk_group"]]
        return flags

    def problems(self):
        c, p = self.c, []
        need = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_num_heads",
                "linear_head_dim"]
        p += [f"config.json: {k} is missing (KimiLinear needs it)" for k in need if c.get(k) is None]
        if p:
            return p
        for key in need + ["linear_conv_kernel_dim"] + (["q_lora_rank"] if self.q_rank is not None else []):
            if not _is_int(c[key]) or c[key] < 1:
                p.append(f"config.json: {key} {c[key]!r}: a positive integer is needed")
        if c["hidden_act"] != "silu":
            p.append(f"config.json: hidden_act {c['hidden_act']!r}: only silu (SwiGLU, and KDA's conv activation) is "
                     f"imported")
        if c.get("attention_bias"):
            p.append("config.json: attention_bias true: megatron's MLA biases every projection or none")
        if c["num_key_value_heads"] != self.heads:
            p.append(f"config.json: num_key_value_heads {c['num_key_value_heads']} != num_attention_heads "
                     f"{self.heads}: MLA has one key and value per head")
        eps = c["rms_norm_eps"]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            p.append(f"config.json: rms_norm_eps {eps!r}: --norm-epsilon takes a positive number (the latent norms' "
                     f"1e-6 is reached by scaling their input by sqrt(rms_norm_eps / 1e-6))")
        if config_flag_false(c, "mla_use_nope"):
            p.append("config.json: mla_use_nope false: the release's modeling code then rotates MLA's "
                     "qk_rope_head_dim dims, which transformers 5.25's KimiLinearAttention never does (NoPE only)")
        linear = c.get("linear_attn_config") or {}
        extra = ", ".join(f"{k} {linear[k]!r}" for k in sorted(set(linear) - set(LINEAR_ATTN_KEYS)
                                                                - {"kda_layers", "full_attn_layers"}))
        if extra:
            p.append(f"config.json: linear_attn_config {extra}: not part of transformers 5.25's Kimi Delta Attention "
                     f"(a low-rank forget gate without a lower bound), so not imported")
        return p + self._layer_problems() + self._moe_problems()

    def _layer_problems(self):
        c, p, n = self.c, [], self.c["num_hidden_layers"]
        listed = "kda_layers" in (c.get("linear_attn_config") or {})
        where = "layer_types" if "layer_types" in self.given else \
            "linear_attn_config's kda_layers / full_attn_layers" if listed else "the default layer_types"
        unknown = sorted({str(t) for t in self.types if t not in (LINEAR, FULL)})
        if unknown or len(self.types) != n:
            p.append(f"config.json: {where} cannot be expressed: --linear-attention-freq takes one of {LINEAR!r} / "
                     f"{FULL!r} per layer, for {n} layers" +
                     (f" (unknown or unset: {unknown})" if unknown else f" (got {len(self.types)})"))
        elif LINEAR not in self.types:
            p.append(f"config.json: {where} has no {LINEAR!r} layer: import a softmax-only model as its own "
                     f"architecture")
        kinds = sorted({str(t) for t in self.mlp_types if t not in (DENSE, SPARSE)})
        if kinds or len(self.mlp_types) != n:
            p.append(f"config.json: mlp_layer_types cannot be expressed: --moe-layer-freq takes {DENSE!r} or "
                     f"{SPARSE!r} per layer, for {n} layers"
                     + (f" (unknown: {kinds})" if kinds else f" (got {len(self.mlp_types)})"))
        freq = c.get("moe_layer_freq", 1)
        if freq != 1 and "mlp_layer_types" not in self.given:
            p.append(f"config.json: moe_layer_freq {freq!r}: transformers 5.25 makes every layer from "
                     f"first_k_dense_replace on an MoE layer (it does not read moe_layer_freq; the release's code "
                     f"does)")
        return p

    def _moe_problems(self):
        c, p = self.c, []
        if SPARSE not in self.mlp_types:
            return p
        for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts"):
            if not _is_int(c.get(key)) or c[key] < 1:
                p.append(f"config.json: {ALIASES.get(key, key)} {c.get(key)!r}: a positive integer is needed "
                         f"(transformers builds the MoE layers with it)")
        if p:
            return p
        if c.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            p.append(f"config.json: moe_router_activation_func {c['moe_router_activation_func']!r}: transformers 5.25 "
                     f"scores experts with sigmoid only")
        topk, renorm = c["num_experts_per_tok"], c["norm_topk_prob"]
        if renorm and topk == 1 or not renorm and topk > 1:
            p.append(f"config.json: moe_renormalize {renorm} with num_experts_per_token {topk}: megatron's sigmoid "
                     f"router renormalizes exactly when top-k > 1")
        groups, top_groups = c["n_group"], c["topk_group"]
        if not _is_int(groups) or groups < 1 or self.experts % groups or not _is_int(top_groups) or top_groups < 1:
            p.append(f"config.json: num_expert_group {groups!r} / topk_group {top_groups!r}: positive integers, the "
                     f"groups dividing num_experts {self.experts}")
        elif self._group_limited():
            if topk // top_groups != 2:
                p.append(f"config.json: num_experts_per_token {topk} / topk_group {top_groups} != 2: transformers "
                         f"ranks expert groups by their top-2 scores, megatron by their top-(topk / group_topk)")
            if config_flag_false(c, "use_grouped_topk"):
                p.append("config.json: use_grouped_topk false with num_expert_group > 1: transformers 5.25 always "
                         "limits the choice to topk_group groups, the release's code then does not")
        return p

    def unused_by_design(self, names):
        mtp = tuple(self.prefix.format(layer=layer) for layer in self.mtp_layers)
        return super().unused_by_design(names) | {n for n in names if mtp and n.startswith(mtp)}

    # ---- tensors: import (unit) ----------------------------------------------------------------------------------

    def _scaled(self, tensor, rows=None):
        """The latent rows (the first ``rows``, all when None) times `latent_scale`, in fp64 (module doc)."""
        a = self.latent_scale()
        if a == 1:
            return tensor
        rows = tensor.shape[0] if rows is None else rows
        return torch.cat([tensor[:rows].double() * a, tensor[rows:].double()])

    def _unscaled(self, tensor, rows=None):
        a = self.latent_scale()
        if a == 1:
            return tensor
        rows = tensor.shape[0] if rows is None else rows
        return torch.cat([tensor[:rows].double() / a, tensor[rows:].double()])

    def kda_unit(self, hf, a, name):
        """A KDA unit (``name`` relative to megatron's self_attention seat) at HF prefix ``a`` (``...self_attn.``)."""
        h, heads, k = self.hidden, self.kda["linear_num_heads"], self.kda["linear_head_dim"]
        taps = self.kda["linear_conv_kernel_dim"]
        section = name.rsplit(".", 1)[-1]
        if name.startswith("in_proj.weight.") and section in SECTIONS:
            return self._get(hf, a + PROJECTIONS[section] + ".weight", (heads * k, h))
        if name.startswith("conv1d.weight.") and section in SECTIONS:
            return self._get(hf, a + CONVS[section] + ".weight", (heads * k, 1, taps))
        if name == "A_log":
            return a_log_to_megatron(self._get(hf, a + "A_log", (1, 1, heads, 1)))
        shapes = {"f_a_proj.weight": (k, h), "f_b_proj.weight": (heads * k, k), "dt_bias": (heads * k,),
                  "beta_proj.weight": (heads, h), "g_a_proj.weight": (k, h), "g_b_proj.weight": (heads * k, k),
                  "out_norm.weight": (k,), "out_proj.weight": (h, heads * k)}
        if name in shapes:
            return self._get(hf, a + CHECKPOINT_NAMES[name], shapes[name])
        raise HFError(f"no Hugging Face tensor maps to megatron's {SELF_ATTENTION}{name}")

    def mla_unit(self, hf, a, name):
        h, heads = self.hidden, self.heads
        q_rows = heads * (self.nope + self.rope_dim)
        if name == "linear_q_proj.weight":
            return self._get(hf, a + "q_proj.weight", (q_rows, h))
        if name == "linear_q_down_proj.weight":
            return self._scaled(self._get(hf, a + "q_a_proj.weight", (self.q_rank, h)))
        if name == "q_layernorm.weight":
            return self._get(hf, a + "q_a_layernorm.weight", (self.q_rank,))
        if name == "linear_q_up_proj.weight":
            return self._get(hf, a + "q_b_proj.weight", (q_rows, self.q_rank))
        if name == "linear_kv_down_proj.weight":
            return self._scaled(self._get(hf, a + "kv_a_proj_with_mqa.weight", (self.kv_rank + self.rope_dim, h)),
                                self.kv_rank)
        if name == "kv_layernorm.weight":
            return self._get(hf, a + "kv_a_layernorm.weight", (self.kv_rank,))
        if name == "linear_kv_up_proj.weight":
            return self._get(hf, a + "kv_b_proj.weight", (heads * (self.nope + self.v), self.kv_rank))
        if name == "linear_proj.weight":
            return self._get(hf, a + "o_proj.weight", (h, heads * self.v))
        raise HFError(f"no Hugging Face tensor maps to megatron's {SELF_ATTENTION}{name}")

    def unit(self, hf, unit):
        if not unit.startswith("decoder.layers."):
            return super().unit(hf, unit)  # the embedding, the output layer, the final norm
        name, layer, expert = layer_unit(unit)
        at, h = self.prefix.format(layer=layer), self.hidden
        if name == "input_layernorm.weight":
            return self._get(hf, at + "input_layernorm.weight", (h,))
        if name == "pre_mlp_layernorm.weight":
            return self._get(hf, at + "post_attention_layernorm.weight", (h,))
        if name.startswith(SELF_ATTENTION):
            seat = self.kda_unit if self.types[layer] == LINEAR else self.mla_unit
            return seat(hf, at + "self_attn.", name[len(SELF_ATTENTION):])
        return self.mlp_unit(hf, at, name, expert)

    def mlp_unit(self, hf, at, name, expert):
        c, h = self.c, self.hidden
        moe = at + "block_sparse_moe."
        if name == "mlp.router.weight":
            return self._get(hf, moe + "gate.weight", (self.experts, h))
        if name == "mlp.router.expert_bias":
            return self._get(hf, moe + "gate.e_score_correction_bias", (self.experts,))
        kind, _, fc = name.partition(".linear_")
        fc, ffn = "linear_" + fc, c.get("moe_intermediate_size")
        if kind == "mlp.experts.experts" and expert is not None:
            e = moe + f"experts.{expert}."
            if fc == "linear_fc1.weight":
                return self.gated(hf, e + "w1.weight", e + "w3.weight", ffn)
            if fc == "linear_fc2.weight":
                return self._get(hf, e + "w2.weight", (h, ffn))
        if kind == "mlp.shared_experts":
            return self.swiglu_unit(hf, moe + "shared_experts.", fc, ffn * c["n_shared_experts"])
        if kind == "mlp":
            dense = at + "mlp." if at + "mlp.gate_proj.weight" in hf.names() else moe
            return self.swiglu_unit(hf, dense, fc, c["intermediate_size"])
        raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")

    # ---- tensors: export (split) ---------------------------------------------------------------------------------

    def kda_split(self, a, name, full):
        section = name.rsplit(".", 1)[-1]
        if name.startswith("in_proj.weight.") and section in SECTIONS:
            return {a + PROJECTIONS[section] + ".weight": full}
        if name.startswith("conv1d.weight.") and section in SECTIONS:
            return {a + CONVS[section] + ".weight": full}
        if name == "A_log":
            return {a + "A_log": a_log_to_hf(full)}
        if name in CHECKPOINT_NAMES:
            return {a + CHECKPOINT_NAMES[name]: full}
        raise HFError(f"megatron's {SELF_ATTENTION}{name} has no Hugging Face tensor in KimiLinear")

    def mla_split(self, a, name, full):
        plain = {"linear_q_proj.weight": "q_proj.weight", "q_layernorm.weight": "q_a_layernorm.weight",
                 "linear_q_up_proj.weight": "q_b_proj.weight", "kv_layernorm.weight": "kv_a_layernorm.weight",
                 "linear_kv_up_proj.weight": "kv_b_proj.weight", "linear_proj.weight": "o_proj.weight"}
        if name in plain:
            return {a + plain[name]: full}
        if name == "linear_q_down_proj.weight":
            return {a + "q_a_proj.weight": self._unscaled(full)}
        if name == "linear_kv_down_proj.weight":
            return {a + "kv_a_proj_with_mqa.weight": self._unscaled(full, self.kv_rank)}
        raise HFError(f"megatron's {SELF_ATTENTION}{name} has no Hugging Face tensor in KimiLinear")

    def split(self, unit, full):
        if not unit.startswith("decoder.layers."):
            return super().split(unit, full)
        name, layer, expert = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        if name == "input_layernorm.weight":
            return {at + "input_layernorm.weight": full}
        if name == "pre_mlp_layernorm.weight":
            return {at + "post_attention_layernorm.weight": full}
        if name.startswith(SELF_ATTENTION):
            seat = self.kda_split if self.types[layer] == LINEAR else self.mla_split
            return seat(at + "self_attn.", name[len(SELF_ATTENTION):], full)
        moe = at + "block_sparse_moe."
        if name == "mlp.router.weight":
            return {moe + "gate.weight": full}
        if name == "mlp.router.expert_bias":
            return {moe + "gate.e_score_correction_bias": full}
        kind, _, fc = name.partition(".linear_")
        fc = "linear_" + fc
        if kind == "mlp.experts.experts" and expert is not None:
            e = moe + f"experts.{expert}."
            if fc == "linear_fc1.weight":
                gate, up = full.chunk(2)
                return {e + "w1.weight": gate, e + "w3.weight": up}
            return {e + "w2.weight": full}
        dense = moe if moe + "gate_proj.weight" in self.import_names else at + "mlp."
        prefix = {"mlp.shared_experts": moe + "shared_experts.", "mlp": dense}.get(kind)
        if prefix is None:
            raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in KimiLinear")
        return self.swiglu_split(prefix, fc, full)


def config_flag_false(config, key):
    """config.json sets ``key`` and sets it false (absent: transformers' behaviour, never refused)."""
    return key in config and config[key] is not None and not config[key]
