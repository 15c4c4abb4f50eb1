"""What every Hugging Face adapter shares: config.json's common flags, and the attention, norm,
embedding and output tensors of a GQA model, HF's tensors <-> each of megatron's full tensors (the
*units* of `cp_ext.models.parameter_slices`: one layer's or one expert's). A family subclasses it with its flags
and its MLP (`mlp_unit`, `mlp_split`); `cp_ext.hf.families` lists them.

Explicit per tensor:
* fused QKV: megatron's ``linear_qkv`` holds, per query group, that group's query heads, then its key
  head, then its value head ([groups x (heads/groups + 2) x head_dim, hidden]); HF keeps q, k, v apart;
* gate/up: megatron's gated ``linear_fc1`` is [gate; up] (the first half goes through the activation);
* experts: HF's per-expert tensors are megatron's expert units ``...experts.linear_fc1.weight.L.E``;
* vocabulary: ``--padded-vocab-size`` is HF's vocabulary, so the softmax sees HF's logits and no more;
* tied embeddings: ``--untie-embeddings-and-output-weights`` unless config.json ties them;
* RoPE: both rotate the two halves of each head (``--rotary-interleaved`` off).
"""

import re

from cp_ext.hf.reader import HFError


def rope_theta(config):
    """rope_theta as Megatron-LM's --rotary-base takes it (an integer)."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise HFError(f"config.json: rope_theta {theta} is not an integer, which --rotary-base needs")
    return int(theta)


def rope_problems(config):
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    return [] if kind in (None, "default") else [f"config.json: rope type {kind!r} cannot be expressed yet (only "
                                                 f"the default RoPE is imported)"]


def layer_unit(unit):
    """(name, layer, expert or None) of a decoder unit: megatron keys a stack of equal layers
    ``decoder.layers.<name>.<layer>[.<expert>]``, and unequal ones (a --moe-layer-freq list)
    ``decoder.layers.<layer>.<name>[.<expert>]``."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.([\w.]+?)(?:\.(\d+))?", unit)
    if m:
        return m.group(2), int(m.group(1)), m.group(3)
    m = re.fullmatch(r"decoder\.layers\.([\w.]+?)\.(\d+)(?:\.(\d+))?", unit)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    raise HFError(f"no Hugging Face tensor maps to megatron's {unit}")


class Adapter:
    """What every architecture shares; subclasses name their HF tensors."""

    prefix = "model.layers.{layer}."
    import_names = frozenset()  # export: the HF tensor names the import read (`cp_ext.hf.convert.TENSORS`)

    def __init__(self, config):
        self.c = config
        self.heads, self.groups = config["num_attention_heads"], config.get("num_key_value_heads")
        self.groups = self.groups or self.heads
        self.hidden = config["hidden_size"]
        self.head_dim = config.get("head_dim") or self.hidden // self.heads

    def model_flags(self):
        """What every family's config.json says the same way: sizes, norms, SwiGLU, RoPE, vocabulary, ties."""
        c = self.c
        flags = ["--num-layers", c["num_hidden_layers"], "--hidden-size", self.hidden,
                 "--ffn-hidden-size", c["intermediate_size"], "--normalization", "RMSNorm",
                 "--norm-epsilon", c.get("rms_norm_eps", 1e-6), *self.mlp_flags(), *self.rope_flags(),
                 "--max-position-embeddings", c["max_position_embeddings"],
                 "--vocab-size", c["vocab_size"], "--padded-vocab-size", c["vocab_size"]]
        if not c.get("tie_word_embeddings", False):
            flags.append("--untie-embeddings-and-output-weights")
        return flags

    def common_flags(self):
        """`model_flags` and grouped-query attention's heads."""
        flags = self.model_flags() + ["--num-attention-heads", self.heads, "--kv-channels", self.head_dim]
        if self.groups != self.heads:
            flags += ["--group-query-attention", "--num-query-groups", self.groups]
        if self.c.get("attention_bias"):
            flags.append("--add-qkv-bias")
        return flags

    def mlp_flags(self):
        """The activation and biases: SwiGLU with no bias (a family with other MLPs overrides it)."""
        return ["--swiglu", "--disable-bias-linear"]

    def rope_flags(self):
        """Plain RoPE (`rope_problems` refuses any other rope type; a family that maps one overrides both)."""
        return ["--position-embedding-type", "rope", "--rotary-base", rope_theta(self.c)]

    def problems(self):
        p = rope_problems(self.c)
        if self.c.get("hidden_act", "silu") != "silu":
            p.append(f"config.json: hidden_act {self.c['hidden_act']!r}: only silu (SwiGLU) is imported")
        if self.c.get("sliding_window") and self.c.get("use_sliding_window", True):
            p.append(f"config.json: sliding_window {self.c['sliding_window']} is not imported for this architecture")
        return p

    def unused_by_design(self, names):
        """HF tensors that carry nothing the model lacks: a tied checkpoint's copy of the embedding as
        lm_head, and RoPE's inv_freq buffers that older checkpoints saved."""
        tied = self.c.get("tie_word_embeddings", False)
        return {n for n in names if (tied and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq")}

    def export_config(self, config):
        """config.json as the export writes it: the import's (a family that imports part of a checkpoint
        rewrites it for that part)."""
        return config

    def _get(self, hf, name, shape):
        self.used.add(name)
        return hf.get(name, shape)

    def unit(self, hf, unit):
        """The full tensor of megatron unit ``unit`` from the HF checkpoint ``hf``."""
        import torch

        c, h, d = self.c, self.hidden, self.head_dim
        if unit == "embedding.word_embeddings.weight":
            return self._get(hf, "model.embed_tokens.weight", (c["vocab_size"], h))
        if unit == "output_layer.weight":
            return self._get(hf, "lm_head.weight", (c["vocab_size"], h))
        if unit == "decoder.final_layernorm.weight":
            return self._get(hf, "model.norm.weight", (h,))
        name, layer, expert = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        if name == "self_attention.linear_qkv.layer_norm_weight":
            return self._get(hf, at + "input_layernorm.weight", (h,))
        if name == "mlp.linear_fc1.layer_norm_weight":
            return self._get(hf, at + "post_attention_layernorm.weight", (h,))
        if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            part = name.rsplit(".", 1)[1]
            shape = lambda rows: (rows, h) if part == "weight" else (rows,)  # noqa: E731
            q = self._get(hf, at + f"self_attn.q_proj.{part}", shape(self.heads * d))
            k = self._get(hf, at + f"self_attn.k_proj.{part}", shape(self.groups * d))
            v = self._get(hf, at + f"self_attn.v_proj.{part}", shape(self.groups * d))
            per = self.heads // self.groups
            q = q.reshape(self.groups, per * d, *q.shape[1:])
            k, v = k.reshape(self.groups, d, *k.shape[1:]), v.reshape(self.groups, d, *v.shape[1:])
            return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])
        if name == "self_attention.linear_proj.weight":
            return self._get(hf, at + "self_attn.o_proj.weight", (h, self.heads * d))
        if name in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):  # Qwen3's q/k norms
            return self._get(hf, at + f"self_attn.{name.split('.')[1][0]}_norm.weight", (d,))
        return self.mlp_unit(hf, at, name, expert)

    def split(self, unit, full):
        """The inverse of `unit`: {HF name: tensor} that megatron's full tensor ``unit`` holds (export)."""
        c, d = self.c, self.head_dim
        if unit == "embedding.word_embeddings.weight":
            return {"model.embed_tokens.weight": full[:c["vocab_size"]]}
        if unit == "output_layer.weight":
            return {"lm_head.weight": full[:c["vocab_size"]]}
        if unit == "decoder.final_layernorm.weight":
            return {"model.norm.weight": full}
        name, layer, expert = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        if name == "self_attention.linear_qkv.layer_norm_weight":
            return {at + "input_layernorm.weight": full}
        if name == "mlp.linear_fc1.layer_norm_weight":
            return {at + "post_attention_layernorm.weight": full}
        if name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            part, per = name.rsplit(".", 1)[1], self.heads // self.groups
            grouped = full.reshape(self.groups, (per + 2) * d, *full.shape[1:])
            q, k, v = grouped.split([per * d, d, d], dim=1)
            return {at + f"self_attn.{n}_proj.{part}": t.reshape(-1, *full.shape[1:]) for n, t in zip("qkv", (q, k, v))}
        if name == "self_attention.linear_proj.weight":
            return {at + "self_attn.o_proj.weight": full}
        if name in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
            return {at + f"self_attn.{name.split('.')[1][0]}_norm.weight": full}
        return self.mlp_split(at, name, expert, full)

    def gated(self, hf, gate, up, rows):
        import torch

        return torch.cat([self._get(hf, gate, (rows, self.hidden)), self._get(hf, up, (rows, self.hidden))])

    def swiglu_unit(self, hf, at, fc, rows):
        """A Llama-style MLP at HF prefix ``at``: megatron's linear_fc1 is [gate_proj; up_proj], fc2 down_proj."""
        if fc == "linear_fc1.weight":
            return self.gated(hf, at + "gate_proj.weight", at + "up_proj.weight", rows)
        return self._get(hf, at + "down_proj.weight", (self.hidden, rows))

    @staticmethod
    def swiglu_split(at, fc, full):
        if fc == "linear_fc1.weight":
            gate, up = full.chunk(2)
            return {at + "gate_proj.weight": gate, at + "up_proj.weight": up}
        return {at + "down_proj.weight": full}
