"""GPT-OSS (``GptOssForCausalLM``): transformers' model <-> megatron's, every tensor and flag explicit.

What differs from the GQA/SwiGLU base (`cp_ext.hf.adapter.Adapter`), each checked against
transformers' ``modeling_gpt_oss.py`` (5.x) and megatron-core 0.16.1:

* biases everywhere (megatron's default, no ``--disable-bias-linear``): q/k/v (fused per query group
  by the base), ``o_proj.bias`` = ``linear_proj.bias``, the router's and every expert's;
* sinks: HF appends ``self_attn.sinks[h]`` as one more logit to every row of head h's softmax and
  drops its column; megatron's ``--softmax-type learnable`` ``softmax_offset[h]`` is the same logit
  (cp_ext adds it after the LSE merge: out * sigmoid(lse - sink), the same softmax);
* sliding windows: HF's ``sliding_window`` W keeps the keys ``q - W < k <= q`` (W keys, the query's
  own included), megatron's ``--window-size W-1,0``; ``layer_types`` becomes
  ``--window-attn-skip-freq``: N where megatron's rule (1-based layer % N != 0 windowed) gives the
  pattern, else the 0/1 list (1: windowed);
* router: HF's top-k of the logits, then softmax over those k = megatron's softmax router without
  ``--moe-router-pre-softmax``;
* experts: HF stacks a layer's experts, ``gate_up_proj`` [E, h, 2 ffn] applied as ``x @ W`` with gate
  and up *interleaved* on the last axis (gate = [..., ::2], up = [..., 1::2]), ``down_proj`` [E, ffn, h];
  megatron's expert units are [2 ffn, h] = [gate; up] and [h, ffn], one per expert;
* activation: HF clamps gate <= limit and up to [-limit, limit], then gate * sigmoid(alpha gate) *
  (up + 1); megatron's GLU with ``--activation-func-clamp-value limit`` clamps the same way in the
  same order, ``--quick-geglu`` is x * sigmoid(1.702 x), ``--glu-linear-offset 1`` the + 1;
* YaRN: transformers' ``_compute_yarn_parameters`` and megatron's ``YarnRotaryEmbedding`` are the same
  formulas (correction range from beta_fast/beta_slow at the original length, a linear ramp between
  interpolated and extrapolated frequencies, cos/sin times the attention factor). Flags:
  ``--position-embedding-type yarn`` with HF's own values, not ``--enable-gpt-oss`` (which sets an
  original length of 131072, Megatron post-training's, where the release says 4096).
"""

from cp_ext.hf.adapter import Adapter, layer_unit, rope_theta
from cp_ext.hf.reader import HFError

SLIDING, FULL = "sliding_attention", "full_attention"
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x), a constant there
EXPERT_TENSORS = {"mlp.experts.experts.linear_fc1.weight": "gate_up_proj",
                  "mlp.experts.experts.linear_fc1.bias": "gate_up_proj_bias",
                  "mlp.experts.experts.linear_fc2.weight": "down_proj",
                  "mlp.experts.experts.linear_fc2.bias": "down_proj_bias"}


def yarn_mscale(factor, mscale=1.0):
    """transformers' (and megatron's) get_mscale."""
    import math

    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class GptOss(Adapter):
    def __init__(self, config):
        super().__init__(config)
        self.experts = config.get("num_local_experts") or config.get("num_experts")
        self.ffn = config.get("intermediate_size")
        self._stacks = {}  # import: {(reader, HF name): stacked tensor}, the last few read
        self._pending = {}  # export: {HF name: {expert: its slice}} until the layer's last expert

    # ---- config.json -> flags -------------------------------------------------------------------------

    def rope(self):
        """HF's rope dict (transformers 5's rope_parameters, or the older rope_scaling), its type."""
        rope = dict(self.c.get("rope_parameters") or self.c.get("rope_scaling") or {})
        return rope, rope.get("rope_type", rope.get("type", "default")) or "default"

    def layer_types(self):
        """config.json's layer_types, or transformers' GptOssConfig default (sliding, full, sliding, ...)."""
        types = self.c.get("layer_types")
        if types is None:
            return [SLIDING if (i + 1) % 2 else FULL for i in range(self.c["num_hidden_layers"])]
        return list(types)

    def yarn(self):
        """(factor, original length, attention factor) as transformers derives them (modeling_rope_utils)."""
        rope, c = self.rope()[0], self.c
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins, then the
        # rope dict's, else max_position_embeddings
        original = c.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
            or c["max_position_embeddings"]
        factor = rope.get("factor")
        if factor is None:  # transformers: the ratio of the lengths
            factor = c["max_position_embeddings"] / original
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
        return float(factor), int(original), attention

    def rope_flags(self):
        rope, kind = self.rope()
        flags = ["--rotary-base", rope_theta(self.c)]
        if kind == "default":
            return ["--position-embedding-type", "rope"] + flags
        factor, original, _ = self.yarn()
        flags = ["--position-embedding-type", "yarn"] + flags + [
            "--rotary-scaling-factor", factor, "--yarn-original-max-position-embeddings", original,
            # transformers reads `beta or default`, so a 0 (or null) is the default too
            "--yarn-beta-fast", float(rope.get("beta_fast") or 32),
            "--yarn-beta-slow", float(rope.get("beta_slow") or 1),
            # truncate (transformers' default True) = megatron's floor/ceil of the correction range
            "--yarn-correction-range-round-to-int" if rope.get("truncate", True)
            else "--no-yarn-correction-range-round-to-int"]
        if rope.get("mscale") and rope.get("mscale_all_dim"):  # else both take get_mscale(factor): megatron's
            flags += ["--mscale", rope["mscale"], "--mscale-all-dim", rope["mscale_all_dim"]]  # 1.0 / 0.0 defaults
        return flags

    def mlp_flags(self):
        # biases on (megatron's default), GPT-OSS's clamped GLU
        return ["--add-bias-linear", "--quick-geglu", "--glu-linear-offset", 1.0,
                "--activation-func-clamp-value", float(self.c.get("swiglu_limit", 7.0))]

    def window_flags(self):
        types = self.layer_types()
        windowed = [t == SLIDING for t in types]
        if not any(windowed):
            return []
        flags = ["--window-size", f"{self.c['sliding_window'] - 1},0"]  # W keys, the query's own among them
        if all(windowed):
            return flags
        for n in range(2, len(types) + 1):  # megatron's int rule: 1-based layer % n != 0 is windowed
            if all(w == ((i + 1) % n != 0) for i, w in enumerate(windowed)):
                return flags + ["--window-attn-skip-freq", n]
        return flags + ["--window-attn-skip-freq", "[" + ",".join(str(int(w)) for w in windowed) + "]"]

    def flags(self):
        c = self.c
        return self.common_flags() + self.window_flags() + [
            "--softmax-type", "learnable", "--num-experts", self.experts, "--moe-router-topk", c["num_experts_per_tok"],
            "--moe-ffn-hidden-size", self.ffn,
            "--moe-aux-loss-coeff", c.get("router_aux_loss_coef", 0.001)]  # GptOssConfig's default

    def problems(self):
        c, p = self.c, []
        need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "num_experts_per_tok",
                "max_position_embeddings", "vocab_size")
        p += [f"config.json: {k} is missing (GptOssForCausalLM needs it)" for k in need if c.get(k) is None]
        if not self.experts:
            p.append("config.json: num_local_experts is missing (GptOssForCausalLM needs the expert count)")
        if c.get("num_experts_per_tok") == 1:  # HF: softmax over the one chosen logit, a weight of 1
            p.append("config.json: num_experts_per_tok 1: megatron's softmax router takes top-1 only with "
                     "--moe-router-pre-softmax, which weights the expert by its softmax over all experts, not by 1")
        if c.get("hidden_act", "silu") != "silu":
            p.append(f"config.json: hidden_act {c['hidden_act']!r}: only GPT-OSS's clamped GLU (the release's 'silu') "
                     f"is imported")
        alpha = c.get("swiglu_alpha", QUICK_GELU_ALPHA)
        if alpha != QUICK_GELU_ALPHA:
            p.append(f"config.json: swiglu_alpha {alpha}: megatron-core's --quick-geglu fixes it at {QUICK_GELU_ALPHA}")
        limit = c.get("swiglu_limit", 7.0)
        if not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
            p.append(f"config.json: swiglu_limit {limit!r}: --activation-func-clamp-value needs a positive number")
        if not c.get("attention_bias", True):
            p.append("config.json: attention_bias false: megatron's biases are all on or all off "
                     "(--add-bias-linear) and GPT-OSS's router and experts have them")
        return p + self._rope_problems() + self._window_problems()

    def _rope_problems(self):
        rope, kind = self.rope()
        c, p = self.c, []
        theta = rope.get("rope_theta", c.get("rope_theta"))
        if theta is None:
            p.append("config.json: rope_theta is missing (in rope_parameters or at the top level)")
        elif float(theta) != int(theta):
            p.append(f"config.json: rope_theta {theta} is not an integer, which --rotary-base needs")
        if kind not in ("default", "yarn"):
            return p + [f"config.json: rope type {kind!r} cannot be expressed (GptOssForCausalLM imports yarn and "
                        f"default RoPE)"]
        if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
            p.append(f"config.json: partial_rotary_factor {rope.get('partial_rotary_factor')}: megatron's YaRN "
                     f"rotates every dim of the head")
        if kind == "default" or c.get("max_position_embeddings") is None:
            return p
        factor, original, attention = self.yarn()
        if factor <= 0:
            p.append(f"config.json: YaRN factor {factor} must be positive (--rotary-scaling-factor)")
        given = rope.get("attention_factor")
        if given is not None and float(given) != attention:  # megatron derives it from factor and mscales only
            p.append(f"config.json: YaRN attention_factor {given} differs from the {attention} that factor {factor} "
                     f"(and mscale/mscale_all_dim) give; megatron's YarnRotaryEmbedding cannot take it")
        return p

    def _window_problems(self):
        c, types = self.c, self.layer_types()
        if c.get("num_hidden_layers") is None:
            return []
        unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
        if unknown or len(types) != c["num_hidden_layers"]:
            return [f"config.json: layer_types {types} cannot be expressed: megatron's --window-size with "
                    f"--window-attn-skip-freq takes one of {SLIDING!r}/{FULL!r} per layer, for "
                    f"{c['num_hidden_layers']} layers" + (f" (unknown: {unknown})" if unknown else "")]
        window = c.get("sliding_window")
        if SLIDING in types and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            return [f"config.json: sliding_window {window!r} with layer_types naming {SLIDING!r}: a window of "
                    f"W >= 1 keys (--window-size W-1,0) is needed"]
        return []

    # ---- tensors: import (unit) and export (split) ------------------------------------------------------

    def unit(self, hf, unit):
        if unit.startswith("decoder.layers."):
            name, layer, _ = layer_unit(unit)
            at = self.prefix.format(layer=layer)
            if name == "self_attention.core_attention.softmax_offset":
                return self._get(hf, at + "self_attn.sinks", (self.heads,))
            if name == "self_attention.linear_proj.bias":
                return self._get(hf, at + "self_attn.o_proj.bias", (self.hidden,))
        return super().unit(hf, unit)

    def split(self, unit, full):
        if unit.startswith("decoder.layers."):
            name, layer, _ = layer_unit(unit)
            at = self.prefix.format(layer=layer)
            if name == "self_attention.core_attention.softmax_offset":
                return {at + "self_attn.sinks": full}
            if name == "self_attention.linear_proj.bias":
                return {at + "self_attn.o_proj.bias": full}
        return super().split(unit, full)

    def _stacked(self, hf, name, shape):
        """A layer's stacked expert tensor, read once for the experts this rank holds (all, or its EP share).
        The import asks for one layer's expert tensors (four: weights and biases of fc1, fc2) in turn, so
        the last four read are kept; keyed by the reader too (the header-only check reads meta tensors)."""
        key = (id(hf), name)
        if key not in self._stacks:
            if len(self._stacks) >= 4:
                del self._stacks[next(iter(self._stacks))]
            self._stacks[key] = self._get(hf, name, shape)
        return self._stacks[key]

    def mlp_unit(self, hf, at, name, expert):
        import torch

        h, ffn, n = self.hidden, self.ffn, self.experts
        if name == "mlp.router.weight":
            return self._get(hf, at + "mlp.router.weight", (n, h))
        if name == "mlp.router.bias":
            return self._get(hf, at + "mlp.router.bias", (n,))
        if name not in EXPERT_TENSORS or expert is None:
            raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")
        e, hf_name = int(expert), at + "mlp.experts." + EXPERT_TENSORS[name]
        if name.endswith("linear_fc1.weight"):  # HF [h, 2 ffn], columns gate0, up0, gate1, ... -> [gate; up] rows
            w = self._stacked(hf, hf_name, (n, h, 2 * ffn))[e]
            return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1).t()
        if name.endswith("linear_fc1.bias"):
            b = self._stacked(hf, hf_name, (n, 2 * ffn))[e]
            return torch.cat([b[0::2], b[1::2]])
        if name.endswith("linear_fc2.weight"):  # HF applies x @ down_proj[e] ([ffn, h]); megatron's weight is [h, ffn]
            return self._stacked(hf, hf_name, (n, ffn, h))[e].t()
        return self._stacked(hf, hf_name, (n, h))[e]

    def mlp_split(self, at, name, expert, full):
        import torch

        if name in ("mlp.router.weight", "mlp.router.bias"):
            return {at + name: full}
        if name not in EXPERT_TENSORS or expert is None:
            raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in GptOss")
        hf_name = at + "mlp.experts." + EXPERT_TENSORS[name]
        if name.endswith("linear_fc1.weight"):  # [gate; up] rows -> interleaved columns of [h, 2 ffn]
            gate, up = full.chunk(2)
            piece = torch.stack([gate.t(), up.t()], dim=-1).reshape(self.hidden, -1)
        elif name.endswith("linear_fc1.bias"):
            piece = torch.stack(full.chunk(2), dim=-1).reshape(-1)
        elif name.endswith("linear_fc2.weight"):
            piece = full.t()
        else:
            piece = full
        # megatron hands one expert at a time; HF's tensor stacks the layer's: emit it with the last expert
        got = self._pending.setdefault(hf_name, {})
        got[int(expert)] = piece
        if len(got) < self.experts:
            return {}
        del self._pending[hf_name]
        return {hf_name: torch.stack([got[e] for e in range(self.experts)])}
