"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5-MoE's language model (``Qwen3_5MoeForCausalLM``, and the
text half of ``Qwen3_5MoeForConditionalGeneration``) <-> megatron's linear-attention hybrid (cp_ext's
``--experimental-attention-variant gated_delta_net``), every tensor and flag explicit. Checked against
transformers 5.x ``modeling_qwen3_next.py`` / ``modeling_qwen3_5_moe.py`` and megatron-core 0.16.1 / 0.19.

config.json -> flags:

* ``layer_types`` (or ``full_attention_interval``, transformers' default 4) -> ``--linear-attention-freq``: N
  where megatron's rule (layer i linear unless (i + 1) % N == 0) gives the pattern, else the 0/1 list
  (1: ``linear_attention``); the ``linear_*`` sizes -> the ``--linear-*`` flags;
* softmax layers: GQA with ``head_dim`` (``--kv-channels``), q/k norms (``--qk-layernorm``), the output gate
  (``--attention-output-gate``), RoPE on the first ``partial_rotary_factor`` of each head (``--rotary-percent``;
  Qwen3.5's mrope is plain RoPE for text, whose three position ids are equal);
* every RMSNorm but the gated one scales by 1 + w (``--apply-layernorm-1p``), ``rms_norm_eps`` -> ``--norm-epsilon``;
* MoE: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``; the shared expert
  (``shared_expert_intermediate_size``) and its sigmoid gate (``--moe-shared-expert-gate``); dense layers
  (``mlp_only_layers``, ``decoder_sparse_step``; Qwen3.5: none) -> ``--moe-layer-freq``; the router as the
  Qwen3-MoE adapter's (`cp_ext.hf.families.Qwen3Moe`): ``norm_topk_prob`` (Qwen3.5: always) is megatron's
  top-k then softmax, without it ``--moe-router-pre-softmax``.

Tensors (HF -> megatron's units; export is the inverse, bit for bit):

* Gated DeltaNet: `cp_ext.hf.gated_delta_net_layout` (``in_proj_qkvz`` / ``in_proj_ba`` de-interleaved into
  megatron's sections; Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` already apart;
  the gated norm's w against megatron's zero-centered 1 + w').
* Softmax attention: transformers' ``q_proj`` holds per head [query_h | gate_h] (2 x head_dim rows);
  megatron's ``linear_qkv`` with the output gate holds per query group [its query heads | their gate heads |
  key | value] (megatron's ``get_query_key_value_tensors``).
* Shared expert: ``mlp.shared_expert.{gate,up,down}_proj`` -> ``mlp.shared_experts.linear_fc1`` ([gate; up])
  / ``linear_fc2``; ``mlp.shared_expert_gate.weight`` [1, hidden] is megatron's ``shared_experts.gate_weight``.

Not imported, by design: the release's MTP head (``mtp.*``), which transformers does not read either, and in a
``Qwen3_5MoeForConditionalGeneration`` checkpoint the vision tower (``model.visual.*``): its language model is
imported (``model.language_model.*``), and the export writes that language model back under the same names
with config.json's ``text_config`` as a ``Qwen3_5MoeForCausalLM`` config (`Qwen3_5Moe.export_config`).
"""

import torch

from cp_ext.hf.adapter import Adapter, layer_unit, rope_theta
from cp_ext.hf.gated_delta_net_layout import (CONV_SECTIONS, IN_PROJ_SECTIONS, ba_grouped, ba_sections,
                                              gated_norm_to_hf, gated_norm_to_megatron, qkvz_grouped, qkvz_sections)
from cp_ext.hf.reader import HFError

LINEAR, FULL = "linear_attention", "full_attention"
GDN = "self_attention."  # megatron's seat of a linear layer's Gated DeltaNet


# --- config.json -------------------------------------------------------------------------------------------

def _rope(config):
    """(rope dict, rope type, partial_rotary_factor): transformers 5's rope_parameters, or a release's top-level
    rope_theta / partial_rotary_factor / rope_scaling (transformers' default factor for these families: 0.25)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return rope, kind, factor


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class Qwen3Next(Adapter):
    """``Qwen3NextForCausalLM``; `Qwen3_5Moe` differs in its GDN projections, its config layout and its MLPs."""

    model = "model."  # where the language model's embedding, layers and final norm live
    separate_projections = False  # Qwen3.5: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a

    def __init__(self, config):
        super().__init__(config)
        c = self.c
        self.prefix = self.model + "layers.{layer}."
        self.experts = c.get("num_experts") or 0
        self.gdn = {k: c.get(k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                         "linear_value_head_dim")}
        self._reads = {}  # import: {(reader, HF name): tensor}, the last few read (a fused tensor feeds several units)
        self._pending = {}  # export: {HF name: {section: tensor}} until every section of a fused tensor is in

    # ---- config.json -> flags ---------------------------------------------------------------------------------

    def layer_types(self):
        c = self.c
        types = c.get("layer_types")
        if types is None:  # transformers' default from full_attention_interval
            n = c.get("full_attention_interval", 4)
            return [LINEAR if (i + 1) % n else FULL for i in range(c["num_hidden_layers"])] if _is_int(n) and n > 0 \
                else []
        return list(types)

    def linear_pattern_flag(self):
        """--linear-attention-freq: N where megatron's rule gives layer_types, else the 0/1 list (1: linear)."""
        linear = [t == LINEAR for t in self.layer_types()]
        for n in range(2, len(linear) + 1):
            if all(w == bool((i + 1) % n) for i, w in enumerate(linear)):
                return n
        return "[" + ",".join(str(int(w)) for w in linear) + "]"

    def moe_pattern(self):
        """1 per MoE layer: transformers' rule (not in mlp_only_layers, num_experts > 0, (i + 1) % step == 0)."""
        c = self.c
        dense, step = set(c.get("mlp_only_layers") or []), c.get("decoder_sparse_step", 1)
        return [int(i not in dense and self.experts > 0 and (i + 1) % step == 0) for i in range(c["num_hidden_layers"])]

    def rope_flags(self):
        _, _, factor = _rope(self.c)
        return ["--position-embedding-type", "rope", "--rotary-base", rope_theta(self.c), "--rotary-percent", factor]

    def flags(self):
        c = self.c
        flags = self.common_flags() + [
            "--qk-layernorm", "--apply-layernorm-1p", "--attention-output-gate",
            "--experimental-attention-variant", "gated_delta_net",
            "--linear-attention-freq", self.linear_pattern_flag(),
            "--linear-conv-kernel-dim", c.get("linear_conv_kernel_dim", 4)]
        for key, value in self.gdn.items():
            flags += ["--" + key.replace("_", "-"), value]
        pattern = self.moe_pattern()
        if any(pattern):
            flags += ["--num-experts", self.experts, "--moe-router-topk", c["num_experts_per_tok"],
                      "--moe-ffn-hidden-size", c["moe_intermediate_size"],
                      "--moe-layer-freq", 1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]",
                      "--moe-aux-loss-coeff", c.get("router_aux_loss_coef", 0.0),
                      "--moe-shared-expert-intermediate-size", c["shared_expert_intermediate_size"],
                      "--moe-shared-expert-gate"]
            if not self.normalizes_top_k():  # softmax over all experts, the top k's weights kept as they are
                flags.append("--moe-router-pre-softmax")
        return flags

    def normalizes_top_k(self):
        return self.c.get("norm_topk_prob", True)  # Qwen3NextConfig's default

    def problems(self):
        c, p = self.c, []
        arch = type(self).__name__
        need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size",
                *self.gdn)
        p += [f"config.json: {k} is missing ({arch} needs it)" for k in need if c.get(k) is None]
        if p:
            return p
        p += super().problems()
        if c.get("attention_bias"):
            p.append("config.json: attention_bias true: megatron's q/k/v biases (--add-qkv-bias) have no o_proj bias "
                     "beside them, which transformers' Qwen3-Next attention then has")
        types = self.layer_types()
        unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
        if unknown or len(types) != c["num_hidden_layers"]:
            where = "layer_types" if c.get("layer_types") is not None else \
                f"full_attention_interval {c.get('full_attention_interval')!r}"
            p.append(f"config.json: {where} cannot be expressed: --linear-attention-freq takes one of {LINEAR!r} / "
                     f"{FULL!r} per layer, for {c['num_hidden_layers']} layers" +
                     (f" (unknown: {unknown})" if unknown else f" (got {len(types)})"))
        elif LINEAR not in types:
            p.append(f"config.json: layer_types has no {LINEAR!r} layer: import a softmax-only model as its own "
                     f"architecture")
        kernel = c.get("linear_conv_kernel_dim", 4)
        if not _is_int(kernel) or kernel < 1:
            p.append(f"config.json: linear_conv_kernel_dim {kernel!r}: --linear-conv-kernel-dim takes a positive "
                     f"integer (the conv's taps)")
        for key, value in self.gdn.items():
            if not _is_int(value) or value < 1:
                p.append(f"config.json: {key} {value!r}: --{key.replace('_', '-')} takes a positive integer")
        hk, hv = self.gdn["linear_num_key_heads"], self.gdn["linear_num_value_heads"]
        if _is_int(hk) and _is_int(hv) and hk > 0 and hv % hk:
            p.append(f"config.json: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}: each "
                     f"key head serves a group of value heads")
        return p + self._rope_problems() + self._moe_problems()

    def _rope_problems(self):
        _, _, factor = _rope(self.c)  # the rope type: `Adapter.problems`
        p = []
        dims = self.head_dim * factor if isinstance(factor, (int, float)) else None
        if dims is None or not 0 < factor <= 1 or dims != int(dims) or int(dims) % 2:
            p.append(f"config.json: partial_rotary_factor {factor!r}: --rotary-percent needs a factor in (0, 1] that "
                     f"rotates an even number of the head's {self.head_dim} dims")
        return p

    def _moe_problems(self):
        c, p = self.c, []
        if not any(self.moe_pattern()):
            return p
        for key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if not _is_int(c.get(key)) or c[key] < 1:
                p.append(f"config.json: {key} {c.get(key)!r}: a positive integer is needed (transformers builds the "
                         f"{'shared expert' if key.startswith('shared') else 'experts'} with it)")
        step = c.get("decoder_sparse_step", 1)
        if not _is_int(step) or step < 1:
            p.append(f"config.json: decoder_sparse_step {step!r} is not a positive integer")
        return p

    def unused_by_design(self, names):
        """`Adapter`'s, and the release's MTP head (transformers skips ``mtp.*`` too)."""
        return super().unused_by_design(names) | {n for n in names if n.startswith("mtp.")}

    # ---- tensors: import (unit) ----------------------------------------------------------------------------------

    def _read(self, hf, name, shape):
        """A tensor several units are cut from (in_proj_qkvz, conv1d, ...), read once for them: the last few kept,
        keyed by the reader too (the header-only check reads meta tensors)."""
        key = (id(hf), name)
        if key not in self._reads:
            if len(self._reads) >= 6:
                del self._reads[next(iter(self._reads))]
            self._reads[key] = self._get(hf, name, shape)
        return self._reads[key]

    def _sizes(self):
        g = self.gdn
        qk = g["linear_num_key_heads"] * g["linear_key_head_dim"]
        return qk, g["linear_num_value_heads"] * g["linear_value_head_dim"], g["linear_num_value_heads"]

    def gdn_unit(self, hf, at, name):
        """A Gated DeltaNet unit (``name`` relative to megatron's self_attention seat) at HF prefix ``at``."""
        h, (qk, v, hv) = self.hidden, self._sizes()
        taps = self.c.get("linear_conv_kernel_dim", 4)
        if name.startswith("in_proj.weight."):
            section = name.rsplit(".", 1)[1]
            if section not in IN_PROJ_SECTIONS:
                raise HFError(f"no Hugging Face tensor maps to megatron's {name}")
            return dict(zip(IN_PROJ_SECTIONS, self._in_proj(hf, at)))[section] if not self.separate_projections \
                else self._separate(hf, at, section)
        if name.startswith("conv1d.weight."):
            conv = self._read(hf, at + "conv1d.weight", (2 * qk + v, 1, taps))
            return dict(zip(CONV_SECTIONS, conv.split([qk, qk, v])))[name.rsplit(".", 1)[1]]
        if name in ("dt_bias", "A_log"):
            return self._get(hf, at + name, (hv,))
        if name == "out_norm.weight":
            return gated_norm_to_megatron(self._get(hf, at + "norm.weight", (self.gdn["linear_value_head_dim"],)))
        if name == "out_proj.weight":
            return self._get(hf, at + "out_proj.weight", (h, v))
        raise HFError(f"no Hugging Face tensor maps to megatron's {name}")

    def _in_proj(self, hf, at):
        """Qwen3-Next's grouped in_proj_qkvz / in_proj_ba -> megatron's six sections."""
        h, (qk, v, hv) = self.hidden, self._sizes()
        qkvz = self._read(hf, at + "in_proj_qkvz.weight", (2 * qk + 2 * v, h))
        ba = self._read(hf, at + "in_proj_ba.weight", (2 * hv, h))
        dims = {k: self.gdn[k] for k in ("linear_num_key_heads", "linear_num_value_heads")}
        return qkvz_sections(qkvz, **self.gdn) + ba_sections(ba, **dims)

    def _separate(self, hf, at, section):
        """Qwen3.5's in_proj_qkv ([q | k | v]), in_proj_z, in_proj_b, in_proj_a."""
        h, (qk, v, hv) = self.hidden, self._sizes()
        if section in CONV_SECTIONS:
            qkv = self._read(hf, at + "in_proj_qkv.weight", (2 * qk + v, h))
            return dict(zip(CONV_SECTIONS, qkv.split([qk, qk, v])))[section]
        name, rows = {"z": ("in_proj_z", v), "beta": ("in_proj_b", hv), "alpha": ("in_proj_a", hv)}[section]
        return self._get(hf, at + name + ".weight", (rows, h))

    def unit(self, hf, unit):
        c, h = self.c, self.hidden
        if unit == "embedding.word_embeddings.weight":
            return self._get(hf, self.model + "embed_tokens.weight", (c["vocab_size"], h))
        if unit == "decoder.final_layernorm.weight":
            return self._get(hf, self.model + "norm.weight", (h,))
        if not unit.startswith("decoder.layers."):
            return super().unit(hf, unit)
        name, layer, _ = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        if self.layer_types()[layer] == LINEAR and name.startswith(GDN) and ".layer_norm_weight" not in name:
            return self.gdn_unit(hf, at + "linear_attn.", name[len(GDN):])
        if name == "self_attention.linear_qkv.weight":
            return self._gated_qkv(hf, at + "self_attn.")
        return super().unit(hf, unit)

    def _gated_qkv(self, hf, a):
        """HF's q_proj (per head [query_h | gate_h]), k_proj, v_proj -> megatron's linear_qkv with the output gate:
        per query group [its query heads | their gate heads | key | value]."""
        d, h, per = self.head_dim, self.hidden, self.heads // self.groups
        q = self._get(hf, a + "q_proj.weight", (2 * self.heads * d, h)).reshape(self.groups, per, 2, d, h)
        k = self._get(hf, a + "k_proj.weight", (self.groups * d, h)).reshape(self.groups, d, h)
        v = self._get(hf, a + "v_proj.weight", (self.groups * d, h)).reshape(self.groups, d, h)
        query, gate = q[:, :, 0].reshape(self.groups, per * d, h), q[:, :, 1].reshape(self.groups, per * d, h)
        return torch.cat([query, gate, k, v], dim=1).reshape(-1, h)

    def mlp_unit(self, hf, at, name, expert):
        c, h = self.c, self.hidden
        if name == "mlp.router.weight":
            return self._get(hf, at + "mlp.gate.weight", (self.experts, h))
        if name == "mlp.shared_experts.gate_weight":
            return self._get(hf, at + "mlp.shared_expert_gate.weight", (1, h))
        kind, _, fc = name.partition(".linear_")
        fc = "linear_" + fc
        if kind == "mlp.experts.experts" and expert is not None:
            return self.swiglu_unit(hf, at + f"mlp.experts.{expert}.", fc, c["moe_intermediate_size"])
        if kind == "mlp.shared_experts":
            return self.swiglu_unit(hf, at + "mlp.shared_expert.", fc, c["shared_expert_intermediate_size"])
        if kind == "mlp":  # a dense layer (mlp_only_layers, decoder_sparse_step)
            return self.swiglu_unit(hf, at + "mlp.", fc, c["intermediate_size"])
        raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")

    # ---- tensors: export (split) ---------------------------------------------------------------------------------

    def _collect(self, name, section, tensor, sections, join):
        """megatron hands a fused HF tensor's sections one unit at a time: emit it with the last one."""
        got = self._pending.setdefault(name, {})
        got[section] = tensor
        if len(got) < len(sections):
            return {}
        del self._pending[name]
        return {name: join(*(got[s] for s in sections))}

    def gdn_split(self, at, name, full):
        qk, v, hv = self._sizes()
        if name.startswith("in_proj.weight.") or name.startswith("conv1d.weight."):
            section = name.rsplit(".", 1)[1]
            if name.startswith("conv1d."):
                return self._collect(at + "conv1d.weight", section, full, CONV_SECTIONS, lambda *t: torch.cat(t))
            if self.separate_projections:
                if section in CONV_SECTIONS:
                    return self._collect(at + "in_proj_qkv.weight", section, full, CONV_SECTIONS,
                                         lambda *t: torch.cat(t))
                return {at + {"z": "in_proj_z", "beta": "in_proj_b", "alpha": "in_proj_a"}[section] + ".weight": full}
            dims = {k: self.gdn[k] for k in ("linear_num_key_heads", "linear_num_value_heads")}
            if section in ("beta", "alpha"):
                return self._collect(at + "in_proj_ba.weight", section, full, ("beta", "alpha"),
                                     lambda b, a: ba_grouped(b, a, **dims))
            return self._collect(at + "in_proj_qkvz.weight", section, full, ("query", "key", "value", "z"),
                                 lambda *t: qkvz_grouped(*t, **self.gdn))
        if name in ("dt_bias", "A_log", "out_proj.weight"):
            return {at + name: full}
        if name == "out_norm.weight":
            return {at + "norm.weight": gated_norm_to_hf(full)}
        raise HFError(f"megatron's {name} has no Hugging Face tensor in {type(self).__name__}")

    def split(self, unit, full):
        if unit == "embedding.word_embeddings.weight":
            return {self.model + "embed_tokens.weight": full[:self.c["vocab_size"]]}
        if unit == "decoder.final_layernorm.weight":
            return {self.model + "norm.weight": full}
        if not unit.startswith("decoder.layers."):
            return super().split(unit, full)
        name, layer, _ = layer_unit(unit)
        at = self.prefix.format(layer=layer)
        if self.layer_types()[layer] == LINEAR and name.startswith(GDN) and ".layer_norm_weight" not in name:
            return self.gdn_split(at + "linear_attn.", name[len(GDN):], full)
        if name == "self_attention.linear_qkv.weight":
            d, h, per = self.head_dim, self.hidden, self.heads // self.groups
            query, gate, k, v = full.reshape(self.groups, -1, h).split([per * d, per * d, d, d], dim=1)
            q = torch.stack([query.reshape(self.groups, per, d, h), gate.reshape(self.groups, per, d, h)], dim=2)
            a = at + "self_attn."
            return {a + "q_proj.weight": q.reshape(-1, h), a + "k_proj.weight": k.reshape(-1, h),
                    a + "v_proj.weight": v.reshape(-1, h)}
        return super().split(unit, full)

    def mlp_split(self, at, name, expert, full):
        if name == "mlp.router.weight":
            return {at + "mlp.gate.weight": full}
        if name == "mlp.shared_experts.gate_weight":
            return {at + "mlp.shared_expert_gate.weight": full}
        kind, _, fc = name.partition(".linear_")
        prefix = {"mlp.experts.experts": at + f"mlp.experts.{expert}.", "mlp.shared_experts": at + "mlp.shared_expert.",
                  "mlp": at + "mlp."}.get(kind)
        if prefix is None:
            raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in {type(self).__name__}")
        return self.swiglu_split(prefix, "linear_" + fc, full)


class Qwen3_5Moe(Qwen3Next):
    """Qwen3.5-MoE's language model: Qwen3-Next's with separate GDN projections (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``), an MoE block on every layer whose router always renormalizes the top k, and, in
    a ``Qwen3_5MoeForConditionalGeneration`` checkpoint, its config in ``text_config`` and its tensors under
    ``model.language_model.``."""

    separate_projections = True

    def __init__(self, config):
        self.multimodal = "text_config" in config
        if self.multimodal:
            self.model = "model.language_model."
            # transformers ties a composite model's embeddings by its top-level tie_word_embeddings
            config = dict(config["text_config"], tie_word_embeddings=config.get("tie_word_embeddings", False))
        config = dict(config)
        config.setdefault("intermediate_size", config.get("moe_intermediate_size"))  # no dense layer: unused
        super().__init__(config)

    def normalizes_top_k(self):
        return True  # Qwen3_5MoeTopKRouter always divides the top k by their sum

    def moe_pattern(self):
        return [1] * self.c["num_hidden_layers"]  # every layer's MLP is the sparse MoE block

    def unused_by_design(self, names):
        """Qwen3-Next's, and a multimodal checkpoint's vision tower (its language model is what cp_ext runs)."""
        return super().unused_by_design(names) | {n for n in names if self.multimodal and n.startswith("model.visual.")}

    def export_config(self, config):
        """A multimodal import exports its language model: config.json's text_config as a Qwen3_5MoeForCausalLM
        config (transformers reads the ``model.language_model.`` names into it)."""
        if not self.multimodal:
            return config
        text = dict(config["text_config"], tie_word_embeddings=config.get("tie_word_embeddings", False))
        for key in ("transformers_version", "dtype", "torch_dtype"):
            if key in config:
                text.setdefault(key, config[key])
        return dict(text, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
