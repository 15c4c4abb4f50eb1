"""DeepseekV32ForCausalLM <-> megatron's multi-latent attention model with DeepSeek sparse attention (DSA).

DeepSeek-V3.2 is DeepSeek-V3 (`cp_ext.hf.deepseek_v3`: MLA, YaRN, the sigmoid router, dense-first layers,
shared experts, all mapped as there) whose every attention layer has a lightning indexer. Its tensors are
mapped explicitly onto megatron's DSA seat (`cp_ext.transformer.dsa`)::

    self_attn.indexer.wq_b          [H D, q_lora_rank]  -> self_attention.core_attention.indexer.linear_wq_b
    self_attn.indexer.wk            [D, hidden]         -> ...indexer.linear_wk
    self_attn.indexer.k_norm        weight, bias [D]    -> ...indexer.k_norm (a LayerNorm, eps 1e-6 in HF)
    self_attn.indexer.weights_proj  [H, hidden]         -> ...indexer.linear_weights_proj

Rows need no permutation: both rotate the first ``qk_rope_head_dim`` values of each indexer head,
non-interleaved (rotate-half), with the model's RoPE (YaRN's mscale included). config.json's ``index_n_heads``,
``index_head_dim`` and ``index_topk`` become ``--dsa-indexer-n-heads``, ``--dsa-indexer-head-dim`` and
``--dsa-indexer-topk``. transformers runs the indexer without the release's Hadamard rotation and FP8
scoring; the rotation is orthogonal and applied to q and k alike, so it changes no score, and cp_ext does
not run it either. FP8 is not emulated on import: the weights are what the checkpoint holds.
"""

from cp_ext.hf.adapter import layer_unit
from cp_ext.hf.deepseek_v3 import DeepseekV3
from cp_ext.hf.reader import HFError

SEAT = "self_attention.core_attention.indexer."
INDEXER = {"linear_wq_b.weight": "wq_b.weight", "linear_wk.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
           "k_norm.bias": "k_norm.bias", "linear_weights_proj.weight": "weights_proj.weight"}
HF_INDEXER_NORM_EPS = 1e-6  # DeepseekV32Indexer's LayerNorm; megatron's takes --norm-epsilon


class DeepseekV32(DeepseekV3):
    def __init__(self, config):
        super().__init__(config)
        self.index_heads, self.index_dim = config.get("index_n_heads", 64), config.get("index_head_dim", 128)
        self.index_topk = config.get("index_topk", 2048)

    def flags(self):
        return super().flags() + ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", self.index_heads,
                                  "--dsa-indexer-head-dim", self.index_dim, "--dsa-indexer-topk", self.index_topk]

    def problems(self):
        c, p = self.c, super().problems()
        if not self.q_rank:
            p.append("config.json: q_lora_rank null: DeepSeek-V3.2's indexer reads q-LoRA's compressed query")
        kinds = set(c.get("layer_types") or ["indexed_attention"])
        if kinds != {"indexed_attention"}:
            p.append(f"config.json: layer_types {sorted(kinds)}: only indexed_attention (DSA on every layer) is "
                     f"imported")
        k = c.get("first_k_dense_replace", 0)
        expected = ["dense" if i < k else "sparse" for i in range(c["num_hidden_layers"])]
        if c.get("mlp_layer_types", expected) != expected:
            p.append(f"config.json: mlp_layer_types {c['mlp_layer_types']} is not first_k_dense_replace {k}'s pattern")
        if self.index_dim < self.rope_dim:
            p.append(f"config.json: index_head_dim {self.index_dim} is smaller than qk_rope_head_dim {self.rope_dim}")
        if c.get("rms_norm_eps", 1e-6) != HF_INDEXER_NORM_EPS:
            p.append(f"config.json: rms_norm_eps {c['rms_norm_eps']}: HF's indexer key norm keeps 1e-6")
        return p

    def _indexer_shapes(self):
        h, heads, d = self.hidden, self.index_heads, self.index_dim
        return {"linear_wq_b.weight": (heads * d, self.q_rank), "linear_wk.weight": (d, h), "k_norm.weight": (d,),
                "k_norm.bias": (d,), "linear_weights_proj.weight": (heads, h)}

    def unit(self, hf, unit):
        if SEAT not in unit:
            return super().unit(hf, unit)
        name, layer, _ = layer_unit(unit)  # decoder.layers.<L>.<name> or decoder.layers.<name>.<L>
        name = name[len(SEAT):]
        if name not in INDEXER:
            raise HFError(f"no Hugging Face tensor maps to megatron's {unit}")
        at = self.prefix.format(layer=layer) + "self_attn.indexer."
        return self._get(hf, at + INDEXER[name], self._indexer_shapes()[name])

    def split(self, unit, full):
        if SEAT not in unit:
            return super().split(unit, full)
        name, layer, _ = layer_unit(unit)
        name = name[len(SEAT):]
        if name not in INDEXER:
            raise HFError(f"megatron's {unit} has no Hugging Face tensor in DeepseekV32")
        return {self.prefix.format(layer=layer) + "self_attn.indexer." + INDEXER[name]: full}
