"""DeepseekV4ForCausalLM (transformers 5.25's layout) <-> cp_ext's DeepSeek-V4 model.

The tensors carry DeepSeek's own names, which transformers keeps on disk (it renames them when it loads and back
when it saves): ``layers.{i}.`` in the release's files, ``model.layers.{i}.`` in what transformers saves (`_naming`);
the export writes the naming the import read. Mapped explicitly, per layer (transformers' module names in brackets):

* attention (`cp_ext.transformer.compressed_attention`): ``attn.wq_a``/``attn.q_norm``/``attn.wq_b`` (q_a_proj, q_a_norm,
  q_b_proj) -> linear_q_down_proj/q_down_norm/linear_q_up_proj; ``attn.wkv``/``attn.norm`` (kv_proj, kv_norm) ->
  linear_kv_proj/kv_layernorm; ``attn.wo_a``/``attn.wo_b`` (o_a_proj, o_b_proj) -> linear_o_group_proj/linear_proj;
  ``attn.attn_sink`` -> sinks. Both lay each head out as [nope | rope] with the rope channels in adjacent pairs, so
  the rows are the same on both sides.
* the compressors: ``attn.compressor.{wkv, wgate, ape, norm}`` -> compressor.{linear_kv, linear_gate, position_bias,
  kv_layernorm}; CSA's indexer ``attn.indexer.{wq_b, weights_proj}`` -> indexer.{linear_q_up_proj, linear_weights},
  its compressor ``attn.indexer.compressor.*`` likewise.
* hyper-connections: ``hc_attn_*``/``hc_ffn_*`` ``{fn, base, scale}`` -> attn_hc/ffn_hc ``{mix_weight, mix_bias,
  mix_scale}``; the model's ``hc_head_{fn, base, scale}`` -> the last layer's hc_head.
* the MoE: ``ffn.gate.weight`` -> router.weight; ``ffn.gate.bias`` (e_score_correction_bias) -> router.expert_bias
  (hash layers have none: their expert bias is 0 and never chooses); ``ffn.gate.tid2eid`` -> router.tid2eid; each
  expert's and the shared expert's ``w1`` (gate), ``w3`` (up) -> megatron's [gate; up], ``w2`` (down).

The release's MTP layer (``mtp.*``) is skipped, as transformers skips it. Configs the flags cannot express are
refused, naming the key: a hash-routed layer after a learned one, a score other than sqrtsoftplus or sigmoid,
unnormalized top-k weights, an hc_eps other than 1e-6, YaRN without truncation, biases, an activation other than SiLU.
"""

import torch

from cp_ext.hf.adapter import Adapter, layer_unit, rope_theta
from cp_ext.hf.reader import HFError

HC_EPS = 1e-6  # cp_ext.transformer.hyper_connections.EPS


def _compress_rope(config):
    rope = dict((config.get("rope_parameters") or {}).get("compress") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


class DeepseekV4(Adapter):
    def __init__(self, config):
        super().__init__(config)
        c = config
        self.head_dim = c["head_dim"]
        partial = c.get("partial_rotary_factor") or 64 / 512
        self.rope_dim = int(self.head_dim * partial)
        self.q_rank, self.experts, self.moe = c["q_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"]
        self.groups_o, self.o_rank = c["o_groups"], c["o_lora_rank"]
        self.rates = c.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        self.kinds = c["layer_types"]
        self.hash_layers = 0  # the leading hash-routed layers (`problems` refuses one after a learned layer)
        for kind in c.get("mlp_layer_types") or []:
            if kind != "hash_moe":
                break
            self.hash_layers += 1
        self.layers = c["num_hidden_layers"]

    # ------------------------------------------------------------------ flags
    def flags(self):
        c, rope = self.c, _compress_rope(self.c)
        ratios = [0 if k == "sliding_attention" else self.rates[k] for k in self.kinds]
        flags = [
            "--num-layers", self.layers, "--hidden-size", self.hidden, "--num-attention-heads", self.heads,
            "--ffn-hidden-size", 4 * self.hidden, "--normalization", "RMSNorm", "--norm-epsilon", c.get("rms_norm_eps", 1e-6),
            "--swiglu", "--disable-bias-linear", "--activation-func-clamp-value", c.get("swiglu_limit", 10.0),
            "--position-embedding-type", "rope", "--rotary-base", rope_theta({"rope_theta": c.get("rope_theta", 10000.0)}),
            "--max-position-embeddings", c["max_position_embeddings"],
            "--vocab-size", c["vocab_size"], "--padded-vocab-size", c["vocab_size"],
            "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", self.q_rank, "--v-head-dim", self.head_dim,
            "--qk-pos-emb-head-dim", self.rope_dim, "--experimental-attention-variant", "dsv4_hybrid",
            "--csa-compress-ratios", "[" + ",".join(map(str, ratios)) + "]",
            "--csa-compress-ratio-for-c", self.rates["compressed_sparse_attention"],
            "--csa-compress-ratio-for-h", self.rates["heavily_compressed_attention"],
            "--csa-window-size", c.get("sliding_window", 128), "--csa-compress-rotary-base", c.get("compress_rope_theta"),
            "--o-groups", self.groups_o, "--o-lora-rank", self.o_rank,
            "--enable-hyper-connections", "--num-residual-streams", c.get("hc_mult", 4),
            "--mhc-sinkhorn-iterations", c.get("hc_sinkhorn_iters", 20),
            "--num-experts", self.experts, "--moe-router-topk", c["num_experts_per_tok"], "--moe-ffn-hidden-size", self.moe,
            "--moe-router-score-function", c.get("scoring_func", "sqrtsoftplus"), "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor", c.get("routed_scaling_factor", 1.0),
            "--moe-n-hash-layers", self.hash_layers, "--moe-router-load-balancing-type", "none",
            "--moe-aux-loss-coeff", 0, "--moe-router-dtype", "fp32"]
        if "compressed_sparse_attention" in self.kinds:  # the CSA layers' indexer
            flags += ["--dsa-indexer-n-heads", c["index_n_heads"], "--dsa-indexer-head-dim", c["index_head_dim"],
                      "--dsa-indexer-topk", c["index_topk"]]
        if c.get("n_shared_experts"):
            flags += ["--moe-shared-expert-intermediate-size", self.moe * c["n_shared_experts"]]
        if not c.get("tie_word_embeddings", False):
            flags.append("--untie-embeddings-and-output-weights")
        if rope["rope_type"] == "yarn":
            flags += ["--rope-type", "yarn", "--rotary-scaling-factor", rope["factor"],
                      "--yarn-original-max-position-embeddings", rope.get("original_max_position_embeddings", 4096),
                      "--yarn-beta-fast", rope.get("beta_fast", 32), "--yarn-beta-slow", rope.get("beta_slow", 1)]
        else:
            flags += ["--rope-type", "rope"]
        return flags

    def problems(self):
        c, rope = self.c, _compress_rope(self.c)
        p = []
        main = (c.get("rope_parameters") or {}).get("main") or {}
        if main.get("rope_type", "default") != "default":
            p.append(f"config.json: rope_parameters.main rope_type {main['rope_type']!r}: the sliding layers' RoPE "
                     f"is imported plain (V4's)")
        if rope["rope_type"] not in ("default", "yarn"):
            p.append(f"config.json: rope_parameters.compress rope_type {rope['rope_type']!r} cannot be expressed")
        if rope["rope_type"] == "yarn" and (not rope.get("truncate", True) or rope.get("attention_factor", 1.0) != 1.0):
            p.append("config.json: rope_parameters.compress: only YaRN with truncate true and attention_factor 1.0 "
                     "(V4's) is imported")
        if c.get("hidden_act", "silu") != "silu":
            p.append(f"config.json: hidden_act {c['hidden_act']!r}: only silu (SwiGLU) is imported")
        for key in ("attention_bias", "mlp_bias"):
            if c.get(key):
                p.append(f"config.json: {key} true: V4's layers have no biases")
        if c.get("num_key_value_heads", 1) != 1:
            p.append(f"config.json: num_key_value_heads {c['num_key_value_heads']}: V4 has one K=V head")
        if c.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid"):
            p.append(f"config.json: scoring_func {c['scoring_func']!r}: only sqrtsoftplus and sigmoid (with the "
                     f"correction bias) are imported")
        if not c.get("norm_topk_prob", True) and c["num_experts_per_tok"] > 1:
            p.append("config.json: norm_topk_prob false: cp_ext's V4 router renormalizes the top-k weights")
        if c.get("hc_eps", HC_EPS) != HC_EPS:
            p.append(f"config.json: hc_eps {c['hc_eps']}: cp_ext's hyper-connections take {HC_EPS} (V4's)")
        mlp = c.get("mlp_layer_types") or []
        if "hash_moe" in mlp[self.hash_layers:]:
            p.append(f"config.json: mlp_layer_types {mlp}: hash-routed layers must come first "
                     f"(--moe-n-hash-layers counts them from layer 1)")
        return p

    def unused_by_design(self, names):
        return super().unused_by_design(names) | {n for n in names if n.startswith("mtp.")}

    # ------------------------------------------------------------------ tensors
    # DeepSeek's tensor names, which transformers keeps on disk (its conversion mapping renames them on load and
    # back on save): per layer, our name -> theirs
    LAYER = {"input_layernorm.weight": "attn_norm.weight", "pre_mlp_layernorm.weight": "ffn_norm.weight",
             "self_attention.linear_q_down_proj.weight": "attn.wq_a.weight",
             "self_attention.q_down_norm.weight": "attn.q_norm.weight",
             "self_attention.linear_q_up_proj.weight": "attn.wq_b.weight",
             "self_attention.linear_kv_proj.weight": "attn.wkv.weight",
             "self_attention.kv_layernorm.weight": "attn.norm.weight",
             "self_attention.linear_o_group_proj.weight": "attn.wo_a.weight",
             "self_attention.linear_proj.weight": "attn.wo_b.weight", "self_attention.sinks": "attn.attn_sink",
             "self_attention.indexer.linear_q_up_proj.weight": "attn.indexer.wq_b.weight",
             "self_attention.indexer.linear_weights.weight": "attn.indexer.weights_proj.weight",
             "mlp.router.weight": "ffn.gate.weight", "mlp.router.expert_bias": "ffn.gate.bias",
             "mlp.router.tid2eid": "ffn.gate.tid2eid",
             **{f"{ours}.{mine}": f"hc_{theirs}_{hf}" for ours, theirs in (("attn_hc", "attn"), ("ffn_hc", "ffn"))
                for mine, hf in (("mix_weight", "fn"), ("mix_bias", "base"), ("mix_scale", "scale"))},
             **{f"{ours}{mine}": f"{theirs}{hf}" for ours, theirs in (("self_attention.compressor.", "attn.compressor."),
                                                                      ("self_attention.indexer.compressor.",
                                                                       "attn.indexer.compressor."))
                for mine, hf in (("linear_kv.weight", "wkv.weight"), ("linear_gate.weight", "wgate.weight"),
                                 ("position_bias", "ape"), ("kv_layernorm.weight", "norm.weight"))}}
    # the model's own, in DeepSeek's release files and as transformers saves them
    TOP = {"release": {"embedding.word_embeddings.weight": "embed.weight", "output_layer.weight": "head.weight",
                       "decoder.final_layernorm.weight": "norm.weight", "hc_head.mix_weight": "hc_head_fn",
                       "hc_head.mix_bias": "hc_head_base", "hc_head.mix_scale": "hc_head_scale"},
           "transformers": {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                            "output_layer.weight": "head.weight", "decoder.final_layernorm.weight": "model.norm.weight",
                            "hc_head.mix_weight": "model.hc_head.hc_fn", "hc_head.mix_bias": "model.hc_head.hc_base",
                            "hc_head.mix_scale": "model.hc_head.hc_scale"}}

    def _naming(self, names):
        """"release" (``layers.{i}.``, ``embed.weight``) or "transformers" (``model.layers.{i}.``)."""
        return "release" if "embed.weight" in names else "transformers"

    def _hf_name(self, naming, name, layer):
        if layer is None or name.startswith("hc_head."):
            return self.TOP[naming].get(name)
        if name == "mlp.router.expert_bias" and layer < self.hash_layers:
            return None  # a hash layer has no correction bias
        suffix = self.LAYER.get(name)
        return None if suffix is None else ("model." if naming == "transformers" else "") + f"layers.{layer}.{suffix}"

    def unit(self, hf, unit):
        parts = getattr(hf, "parts", None)
        naming = self._naming(parts if parts is not None else hf.hf.parts)
        name, layer, expert = layer_unit(unit) if unit.startswith("decoder.layers.") else (unit, None, None)
        if name == "mlp.router.expert_bias" and layer < self.hash_layers:
            return torch.zeros(self.experts)  # a hash layer's bias never chooses (the checkpoint has none)
        theirs = self._hf_name(naming, name, layer)
        if theirs is not None:
            return self._get(hf, theirs, None)
        at = ("model." if naming == "transformers" else "") + f"layers.{layer}.ffn."
        fc = "linear_fc" + name.split("linear_fc")[1] if "linear_fc" in name else None
        if name.startswith("mlp.experts.experts.linear_fc"):
            return self._w13(hf, at + f"experts.{expert}.", fc, self.moe)
        if name.startswith("mlp.shared_experts.linear_fc"):
            return self._w13(hf, at + "shared_experts.", fc, self.moe * self.c.get("n_shared_experts", 1))
        raise HFError(f"no Hugging Face tensor maps to megatron's {unit}")

    def _w13(self, hf, at, fc, rows):
        """DeepSeek's expert: w1 (gate), w3 (up) -> megatron's [gate; up]; w2 (down)."""
        if fc == "linear_fc1.weight":
            return self.gated(hf, at + "w1.weight", at + "w3.weight", rows)
        return self._get(hf, at + "w2.weight", (self.hidden, rows))

    def split(self, unit, full):
        naming = self._naming(self.import_names)
        name, layer, expert = layer_unit(unit) if unit.startswith("decoder.layers.") else (unit, None, None)
        if name == "mlp.router.expert_bias" and layer < self.hash_layers:
            return {}
        theirs = self._hf_name(naming, name, layer)
        if theirs is not None:
            return {theirs: full}
        at = ("model." if naming == "transformers" else "") + f"layers.{layer}.ffn."
        prefix = {"mlp.experts.experts": at + f"experts.{expert}.", "mlp.shared_experts": at + "shared_experts."}.get(
            name.partition(".linear_")[0])
        if prefix is None:
            raise HFError(f"megatron's {unit} has no Hugging Face tensor in DeepseekV4")
        if "linear_fc1" in name:
            gate, up = full.chunk(2)
            return {prefix + "w1.weight": gate, prefix + "w3.weight": up}
        return {prefix + "w2.weight": full}
