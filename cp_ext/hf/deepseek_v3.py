"""DeepseekV3ForCausalLM <-> megatron's multi-latent attention model (DeepSeek-V3, R1, and V2-style MLA).

Mapped explicitly:
* MLA: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (q-LoRA) or ``q_proj`` -> linear_q_down_proj/q_layernorm/
  linear_q_up_proj or linear_q_proj; ``kv_a_proj_with_mqa``/``kv_a_layernorm``/``kv_b_proj`` ->
  linear_kv_down_proj/kv_layernorm/linear_kv_up_proj. The per-head [nope; rope] and latent [kv; k_rope] row
  orders are the same on both sides.
* RoPE interleaving: with ``rope_interleave`` (the release's) HF rotates adjacent pairs (x0, x1), (x2, x3), ...,
  and so does megatron's MLA (its apply_rotary_pos_emb de-interleaves for multi_latent_attention). Without it
  HF rotates the two halves (x_i, x_{i+d/2}): the rope rows of the query and key projections are permuted so
  that half i and half i + d/2 become pair i, and q.k is the same sum.
* YaRN: factor, mscale, mscale_all_dim -> --rotary-scaling-factor, --mscale, --mscale-all-dim;
  original_max_position_embeddings, beta_fast, beta_slow -> --yarn-original-max-position-embeddings,
  --yarn-beta-fast, --yarn-beta-slow (megatron's MLA config's window and betas); megatron's MLA always rounds
  the correction range, so ``truncate: false`` is refused.
* routing: sigmoid scores, ``e_score_correction_bias`` (megatron's expert_bias) for the choice only, groups
  ranked by their top-2 scores (megatron ranks by top-(topk / group_topk): the same when that is 2), the
  chosen scores renormalized and scaled by ``routed_scaling_factor``;
* dense-first layers (``first_k_dense_replace``) -> --moe-layer-freq; shared experts -> megatron's
  shared_experts of moe_intermediate_size x n_shared_experts.
The release's MTP layer (layers >= num_hidden_layers) is skipped: transformers does not read it either.
"""

import torch

from cp_ext.hf.adapter import Adapter, layer_unit, rope_problems
from cp_ext.hf.reader import HFError

# YaRN's window and betas, config.json -> the YaRN flags (megatron's MLA config: original_max_position_embeddings,
# beta_fast, beta_slow), with megatron's defaults where config.json has none
MLA_YARN_FLAGS = {"original_max_position_embeddings": ("--yarn-original-max-position-embeddings", 4096),
                  "beta_fast": ("--yarn-beta-fast", 32), "beta_slow": ("--yarn-beta-slow", 1)}
RMS_EPS_OF_LATENT_NORMS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps


def _rope(config):
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


class DeepseekV3(Adapter):
    def __init__(self, config):
        super().__init__(config)
        c = config
        self.experts = c["n_routed_experts"]
        self.nope, self.rope_dim, self.v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.q_rank, self.kv_rank = c.get("q_lora_rank"), c["kv_lora_rank"]
        self.mtp_layers = range(c["num_hidden_layers"], c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0))

    def flags(self):
        c, rope = self.c, _rope(self.c)
        k = c.get("first_k_dense_replace", 0)
        flags = self.model_flags() + [
            "--num-attention-heads", self.heads, "--multi-latent-attention", "--kv-lora-rank", self.kv_rank,
            "--qk-head-dim", self.nope, "--qk-pos-emb-head-dim", self.rope_dim, "--v-head-dim", self.v,
            "--qk-layernorm", "--num-experts", self.experts, "--moe-ffn-hidden-size", c["moe_intermediate_size"],
            "--moe-layer-freq", "[" + ",".join("0" if i < k else "1" for i in range(c["num_hidden_layers"])) + "]",
            "--moe-router-topk", c["num_experts_per_tok"], "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", c.get("routed_scaling_factor", 1.0),
            "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-aux-loss-coeff", 1e-4]  # DeepSeek-V3's sequence-wise balance loss, alpha = 0.0001
        if self.q_rank:
            flags += ["--q-lora-rank", self.q_rank]
        if c.get("n_shared_experts"):
            flags += ["--moe-shared-expert-intermediate-size", c["moe_intermediate_size"] * c["n_shared_experts"]]
        if self._group_limited():
            flags += ["--moe-router-num-groups", c["n_group"], "--moe-router-group-topk", c["topk_group"]]
        if rope["rope_type"] == "yarn":
            # HF's attention factor is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) only when
            # both are set, else get_mscale(factor): megatron's with --mscale 1 --mscale-all-dim 0.
            both = rope.get("mscale") and rope.get("mscale_all_dim")
            flags += ["--rope-type", "yarn", "--rotary-scaling-factor", rope["factor"],
                      "--mscale", rope["mscale"] if both else 1.0, "--mscale-all-dim", rope.get("mscale_all_dim") or 0.0]
            for key, (flag, default) in MLA_YARN_FLAGS.items():
                flags += [flag, rope.get(key) if rope.get(key) is not None else default]
        else:
            flags += ["--rope-type", "rope"]
        return flags

    def _group_limited(self):
        return (self.c.get("n_group") or 1) > 1 and self.c.get("topk_group", 1) < self.c["n_group"]

    def problems(self):
        c, rope = self.c, _rope(self.c)
        p = [] if rope["rope_type"] == "yarn" else rope_problems(c)
        if rope["rope_type"] == "yarn":
            if not rope.get("truncate", True):
                p.append("config.json: rope_parameters truncate false: megatron's multi-latent attention always "
                         "rounds YaRN's correction range")
            if rope.get("factor") is None or rope.get("attention_factor") is not None:
                p.append("config.json: rope_parameters needs an explicit factor and no attention_factor for "
                         "megatron's MLA YaRN")
        if c.get("hidden_act", "silu") != "silu":
            p.append(f"config.json: hidden_act {c['hidden_act']!r}: only silu (SwiGLU) is imported")
        if c.get("attention_bias"):
            p.append("config.json: attention_bias true: megatron's MLA biases every projection or none")
        if c.get("rms_norm_eps", 1e-6) != RMS_EPS_OF_LATENT_NORMS:
            p.append(f"config.json: rms_norm_eps {c['rms_norm_eps']}: HF's latent norms keep 1e-6 while megatron's "
                     f"take --norm-epsilon, so only 1e-6 imports exactly")
        if c.get("num_key_value_heads", self.heads) != self.heads:
            p.append(f"config.json: num_key_value_heads {c['num_key_value_heads']} != num_attention_heads: MLA has "
                     f"one key and value per head")
        topk = c["num_experts_per_tok"]
        if not c.get("norm_topk_prob", True) and topk > 1 or c.get("norm_topk_prob", True) and topk == 1:
            p.append(f"config.json: norm_topk_prob {c.get('norm_topk_prob')} with num_experts_per_tok {topk}: "
                     f"megatron's sigmoid router renormalizes exactly when top-k > 1")
        if self._group_limited() and topk // c["topk_group"] != 2:
            p.append(f"config.json: num_experts_per_tok {topk} / topk_group {c['topk_group']} != 2: HF ranks expert "
                     f"groups by their top-2 scores, megatron by their top-(topk / group_topk)")
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            p.append(f"config.json: topk_method {c['topk_method']!r}: only noaux_tc (DeepSeek-V3's) is imported")
        return p

    def unused_by_design(self, names):
        mtp = tuple(self.prefix.format(layer=layer) for layer in self.mtp_layers)
        return super().unused_by_design(names) | {n for n in names if mtp and n.startswith(mtp)}

    # RoPE rows without rope_interleave: HF's halves -> megatron's pairs (import), and back (export).
    def _interleave(self, rows, inverse=False):
        if self.c.get("rope_interleave", True):
            return rows
        d = self.rope_dim
        order = torch.stack([torch.arange(d // 2), torch.arange(d // 2, d)], dim=1).flatten()  # 0, d/2, 1, d/2+1, ...
        order = order.to(rows.device)
        if inverse:
            order = torch.argsort(order)
        return rows[..., order, :]

    def _q(self, full, inverse=False):
        per_head = full.reshape(self.heads, self.nope + self.rope_dim, -1)
        nope, rope = per_head.split([self.nope, self.rope_dim], dim=1)
        return torch.cat([nope, self._interleave(rope, inverse)], dim=1).reshape(full.shape)

    def _kv_down(self, full, inverse=False):
        latent, rope = full.split([self.kv_rank, self.rope_dim])
        return torch.cat([latent, self._interleave(rope, inverse)])

    def unit(self, hf, unit):
        name, layer, expert = layer_unit(unit) if unit.startswith("decoder.layers.") else (unit, None, None)
        at, h = self.prefix.format(layer=layer), self.hidden
        a = at + "self_attn."
        q_rows = self.heads * (self.nope + self.rope_dim)
        simple = {"input_layernorm.weight": (at + "input_layernorm.weight", (h,)),
                  "pre_mlp_layernorm.weight": (at + "post_attention_layernorm.weight", (h,)),
                  "self_attention.linear_q_down_proj.weight": (a + "q_a_proj.weight", (self.q_rank, h)),
                  "self_attention.q_layernorm.weight": (a + "q_a_layernorm.weight", (self.q_rank,)),
                  "self_attention.kv_layernorm.weight": (a + "kv_a_layernorm.weight", (self.kv_rank,)),
                  "self_attention.linear_kv_up_proj.weight":
                      (a + "kv_b_proj.weight", (self.heads * (self.nope + self.v), self.kv_rank)),
                  "self_attention.linear_proj.weight": (a + "o_proj.weight", (h, self.heads * self.v))}
        if layer is None:
            return super().unit(hf, unit)
        if name in simple:
            return self._get(hf, *simple[name])
        if name == "self_attention.linear_q_up_proj.weight":
            return self._q(self._get(hf, a + "q_b_proj.weight", (q_rows, self.q_rank)))
        if name == "self_attention.linear_q_proj.weight":
            return self._q(self._get(hf, a + "q_proj.weight", (q_rows, h)))
        if name == "self_attention.linear_kv_down_proj.weight":
            return self._kv_down(self._get(hf, a + "kv_a_proj_with_mqa.weight", (self.kv_rank + self.rope_dim, h)))
        return self.mlp_unit(hf, at, name, expert)

    def mlp_unit(self, hf, at, name, expert):
        c = self.c
        if name == "mlp.router.weight":
            return self._get(hf, at + "mlp.gate.weight", (self.experts, self.hidden))
        if name == "mlp.router.expert_bias":
            return self._get(hf, at + "mlp.gate.e_score_correction_bias", (self.experts,))
        kind, _, fc = name.partition(".linear_")
        fc = "linear_" + fc
        if kind == "mlp.experts.experts":
            return self.swiglu_unit(hf, at + f"mlp.experts.{expert}.", fc, c["moe_intermediate_size"])
        if kind == "mlp.shared_experts":
            return self.swiglu_unit(hf, at + "mlp.shared_experts.", fc, c["moe_intermediate_size"] * c["n_shared_experts"])
        if kind == "mlp":
            return self.swiglu_unit(hf, at + "mlp.", fc, c["intermediate_size"])
        raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")

    def split(self, unit, full):
        if not unit.startswith("decoder.layers."):
            return super().split(unit, full)
        name, layer, expert = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        a = at + "self_attn."
        simple = {"input_layernorm.weight": at + "input_layernorm.weight",
                  "pre_mlp_layernorm.weight": at + "post_attention_layernorm.weight",
                  "self_attention.linear_q_down_proj.weight": a + "q_a_proj.weight",
                  "self_attention.q_layernorm.weight": a + "q_a_layernorm.weight",
                  "self_attention.kv_layernorm.weight": a + "kv_a_layernorm.weight",
                  "self_attention.linear_kv_up_proj.weight": a + "kv_b_proj.weight",
                  "self_attention.linear_proj.weight": a + "o_proj.weight",
                  "mlp.router.weight": at + "mlp.gate.weight",
                  "mlp.router.expert_bias": at + "mlp.gate.e_score_correction_bias"}
        if name in simple:
            return {simple[name]: full}
        if name == "self_attention.linear_q_up_proj.weight":
            return {a + "q_b_proj.weight": self._q(full, inverse=True)}
        if name == "self_attention.linear_q_proj.weight":
            return {a + "q_proj.weight": self._q(full, inverse=True)}
        if name == "self_attention.linear_kv_down_proj.weight":
            return {a + "kv_a_proj_with_mqa.weight": self._kv_down(full, inverse=True)}
        kind, _, fc = name.partition(".linear_")
        prefix = {"mlp.experts.experts": at + f"mlp.experts.{expert}.", "mlp.shared_experts": at + "mlp.shared_experts.",
                  "mlp": at + "mlp."}.get(kind)
        if prefix is None:
            raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in DeepseekV3")
        return self.swiglu_split(prefix, "linear_" + fc, full)

