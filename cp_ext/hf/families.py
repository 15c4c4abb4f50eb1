"""One adapter per Hugging Face architecture (`ARCHITECTURES`): its flags and its MLP's tensors; what
they share is `cp_ext.hf.adapter.Adapter`. DeepSeek-V3 (MLA, sigmoid groups) and GPT-OSS
(sinks, windows, stacked biased experts, YaRN) have their own modules, `cp_ext.hf.deepseek_v3` and `cp_ext.hf.gpt_oss`,
and so do the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5-MoE (`cp_ext.hf.qwen3_next`) and the Kimi Delta
Attention hybrid Kimi-Linear (`cp_ext.hf.kimi_linear`)."""

from cp_ext.hf.adapter import Adapter
from cp_ext.hf.deepseek_v3 import DeepseekV3
from cp_ext.hf.deepseek_v32 import DeepseekV32
from cp_ext.hf.deepseek_v4 import DeepseekV4
from cp_ext.hf.gpt_oss import GptOss
from cp_ext.hf.kimi_linear import KimiLinear
from cp_ext.hf.qwen3_next import Qwen3_5Moe, Qwen3Next
from cp_ext.hf.reader import HFError


class Qwen3Moe(Adapter):
    def flags(self):
        c = self.c
        experts = c.get("num_experts") or c.get("num_local_experts")
        dense = set(c.get("mlp_only_layers") or [])
        step = c.get("decoder_sparse_step", 1)
        pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(c["num_hidden_layers"])]
        flags = self.common_flags() + ["--qk-layernorm", "--num-experts", experts,
                                       "--moe-router-topk", c["num_experts_per_tok"],
                                       "--moe-ffn-hidden-size", c["moe_intermediate_size"],
                                       "--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]",
                                       "--moe-aux-loss-coeff", c.get("router_aux_loss_coef", 0.0)]
        if not c.get("norm_topk_prob", False):  # softmax over all experts, the top k's weights kept as they are
            flags.append("--moe-router-pre-softmax")
        return flags

    def mlp_unit(self, hf, at, name, expert):
        c, h = self.c, self.hidden
        experts = c.get("num_experts") or c.get("num_local_experts")
        if name == "mlp.router.weight":
            return self._get(hf, at + "mlp.gate.weight", (experts, h))
        ffn = c["moe_intermediate_size"]
        if name == "mlp.experts.experts.linear_fc1.weight":
            e = at + f"mlp.experts.{expert}."
            return self.gated(hf, e + "gate_proj.weight", e + "up_proj.weight", ffn)
        if name == "mlp.experts.experts.linear_fc2.weight":
            return self._get(hf, at + f"mlp.experts.{expert}.down_proj.weight", (h, ffn))
        if name == "mlp.linear_fc1.weight":  # a dense layer (mlp_only_layers)
            return self.gated(hf, at + "mlp.gate_proj.weight", at + "mlp.up_proj.weight", c["intermediate_size"])
        if name == "mlp.linear_fc2.weight":
            return self._get(hf, at + "mlp.down_proj.weight", (h, c["intermediate_size"]))
        raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")

    def mlp_split(self, at, name, expert, full):
        gate, up = full.chunk(2) if "linear_fc1" in name else (None, None)
        if name == "mlp.router.weight":
            return {at + "mlp.gate.weight": full}
        if name == "mlp.experts.experts.linear_fc1.weight":
            return {at + f"mlp.experts.{expert}.gate_proj.weight": gate, at + f"mlp.experts.{expert}.up_proj.weight": up}
        if name == "mlp.experts.experts.linear_fc2.weight":
            return {at + f"mlp.experts.{expert}.down_proj.weight": full}
        if name == "mlp.linear_fc1.weight":
            return {at + "mlp.gate_proj.weight": gate, at + "mlp.up_proj.weight": up}
        if name == "mlp.linear_fc2.weight":
            return {at + "mlp.down_proj.weight": full}
        raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in {type(self).__name__}")


class Mixtral(Adapter):
    def flags(self):
        c = self.c
        # HF's Mixtral: softmax over all experts, top-k, renormalized: megatron's top-k, then softmax
        return self.common_flags() + ["--num-experts", c["num_local_experts"],
                                      "--moe-router-topk", c["num_experts_per_tok"],
                                      "--moe-ffn-hidden-size", c["intermediate_size"],
                                      "--moe-aux-loss-coeff", c.get("router_aux_loss_coef", 0.0)]

    def problems(self):
        p = super().problems()
        if self.c.get("router_jitter_noise"):
            p.append(f"config.json: router_jitter_noise {self.c['router_jitter_noise']} is not imported")
        return p

    def mlp_unit(self, hf, at, name, expert):
        c, h, ffn = self.c, self.hidden, self.c["intermediate_size"]
        if name == "mlp.router.weight":
            return self._get(hf, at + "block_sparse_moe.gate.weight", (c["num_local_experts"], h))
        e = at + f"block_sparse_moe.experts.{expert}."
        if name == "mlp.experts.experts.linear_fc1.weight":
            return self.gated(hf, e + "w1.weight", e + "w3.weight", ffn)
        if name == "mlp.experts.experts.linear_fc2.weight":
            return self._get(hf, e + "w2.weight", (h, ffn))
        raise HFError(f"no Hugging Face tensor maps to megatron's decoder.layers.{name}")

    def mlp_split(self, at, name, expert, full):
        e = at + f"block_sparse_moe.experts.{expert}."
        if name == "mlp.router.weight":
            return {at + "block_sparse_moe.gate.weight": full}
        if name == "mlp.experts.experts.linear_fc1.weight":
            gate, up = full.chunk(2)
            return {e + "w1.weight": gate, e + "w3.weight": up}
        if name == "mlp.experts.experts.linear_fc2.weight":
            return {e + "w2.weight": full}
        raise HFError(f"megatron's decoder.layers.{name} has no Hugging Face tensor in Mixtral")


ARCHITECTURES = {"Qwen3MoeForCausalLM": Qwen3Moe, "MixtralForCausalLM": Mixtral, "DeepseekV3ForCausalLM": DeepseekV3,
                 "DeepseekV4ForCausalLM": DeepseekV4,
                 "DeepseekV32ForCausalLM": DeepseekV32, "GptOssForCausalLM": GptOss,
                 "Qwen3NextForCausalLM": Qwen3Next, "Qwen3_5MoeForCausalLM": Qwen3_5Moe,
                 "Qwen3_5MoeForConditionalGeneration": Qwen3_5Moe, "KimiLinearForCausalLM": KimiLinear}


# Architectures close to a supported one that cp_ext does not run, and the difference (beyond the config).
NOT_SUPPORTED = {
    "GlmMoeDsaForCausalLM": "GLM-5's DSA is DeepSeek-V3.2's with two model differences, not only config: its indexer "
                            "rotates interleaved pairs (V3.2's rotates the halves) and its 'shared' layers "
                            "(indexer_types) reuse the previous layer's top-k instead of running an indexer",
}


def adapter_for(config, where):
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            adapter = ARCHITECTURES[arch](config)
            adapter.used = set()
            return adapter
    for arch in archs:
        if arch in NOT_SUPPORTED:
            raise HFError(f"{where}: architecture {arch} is not supported: {NOT_SUPPORTED[arch]}")
    raise HFError(f"{where}: architecture {archs} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
