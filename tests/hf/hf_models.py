"""Small random Hugging Face models, built with transformers' own config classes (no hub), one per
family that tools/convert_hf.py imports; their norms (and routing biases) are perturbed so a dropped
one shows. `SHARDS`: how each is saved (sharded with an index at that size, or one file)."""

SHARDS = {"qwen3_moe": "40KB", "mixtral": None, "deepseek_v3": "60KB", "deepseek_v3_no_q_lora": None,
          "gpt_oss": "40KB", "deepseek_v32": "60KB"}
# the Gated DeltaNet hybrids (tests/hf/test_qwen3_next.py: scored by their own worker, not tools/generate.py)
LINEAR_SHARDS = {"qwen3_next": "40KB", "qwen3_5_moe": None}
# the Kimi Delta Attention hybrids (tests/hf/test_kimi_linear.py, likewise)
KIMI_SHARDS = {"kimi_linear": "40KB", "kimi_linear_q_lora": None}
# DeepSeek-V4 (tests/hf/test_deepseek_v4.py, likewise)
V4_SHARDS = {"deepseek_v4": "60KB"}


def _v4_config():
    """DeepSeek-V4 in miniature: a sliding layer, two CSA layers (an entry per 4 tokens, a 16-head indexer keeping
    each query's top 3) around an HCA layer (an entry per 8 tokens), a window of 8, one K=V head of 16 with 4 rotated
    channels (YaRN on the compressed layers), q-LoRA 12, 2 output groups, 4 hyper-connection streams; the first MoE
    layer hash-routed, the rest sqrtsoftplus with the correction bias and a routed scale of 1.5, a shared expert,
    SwiGLU clamped at 1 (so that the clamp bites)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=384, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        partial_rotary_factor=0.25, q_lora_rank=12, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=8,
        index_topk=3, sliding_window=8, compress_rope_theta=160000.0, rope_theta=10000.0,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=1.5, hc_mult=4, hc_sinkhorn_iters=20,
        swiglu_limit=1.0, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0})


def _config(family):
    from transformers import DeepseekV3Config, DeepseekV32Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if family in LINEAR_SHARDS:
        return _linear_config(family)
    if family in KIMI_SHARDS:
        return _kimi_config(family)
    if family in V4_SHARDS:
        return _v4_config()
    if family == "qwen3_moe":
        return Qwen3MoeConfig(vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                              max_position_embeddings=128, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=128)
    if family == "deepseek_v3":
        # DeepSeek-V3's shape in miniature: q-LoRA, interleaved RoPE rows with YaRN (factor 40 over 4096
        # positions, mscale 1/1), one dense layer first, a shared expert, 8 experts in 2 groups of which each
        # token may use 1 (ranked by the top-2 sum), top-2 renormalized and scaled by 2.5.
        return DeepseekV3Config(
            vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, rope_interleave=True,
            max_position_embeddings=163840, rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                          "beta_fast": 32, "beta_slow": 1})
    if family == "deepseek_v32":
        # DeepSeek-V3.2 in miniature: the V3 shape above with a lightning indexer on every layer (16 heads of dim
        # 8, the first 4 rotated) choosing each token's top 7 keys (a 61-token prompt: 9x index_topk). 16
        # heads, not 4: a score is exactly 0 only where every head's ReLU is, and such ties at the k-th key are
        # broken by position here and by torch.topk's kernel in transformers (the test checks there are none)
        return DeepseekV32Config(
            vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5,
            index_n_heads=16, index_head_dim=8, index_topk=7, max_position_embeddings=163840,
            rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                             "rope_theta": 10000.0})
    if family == "gpt_oss":
        # GPT-OSS's release shape at toy size: alternating sliding (8 keys, so a 62-token prompt passes it) and
        # full layers, the release's YaRN (factor 32 from 4096 positions, beta 32/1, truncate false; head dim 8
        # puts the ramp across the frequencies), biases and sinks; a clamp of 1.0 (not 7) so that it bites
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
        return GptOssConfig(vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=32 * 4096,
                            rope_parameters=yarn, swiglu_limit=1.0,
                            # transformers' readable eager paths (the sinks need eager attention on CPU)
                            attn_implementation="eager", experts_implementation="eager")
    # DeepSeek-V2-Lite's attention: no q-LoRA, plain RoPE, rows not interleaved; top-1 of 4, not renormalized
    return DeepseekV3Config(
        vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=1, n_group=1,
        topk_group=1, n_shared_experts=2, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, norm_topk_prob=False, rope_interleave=False,
        max_position_embeddings=128, routed_scaling_factor=1.0)


def _linear_config(family):
    """Qwen3-Next's and Qwen3.5-MoE's shapes in miniature: softmax layers with q/k norms, the output gate and GQA
    (4 heads of 16 over 2 groups), Gated DeltaNet layers with 2 key heads of 8 serving 4 value heads of 8 and a
    4-tap conv, 4 experts (top 2) with a gated shared expert.
    * Qwen3-Next: linear and softmax layers alternating (full_attention_interval 2), a dense first layer
      (mlp_only_layers), the top 2 not renormalized (--moe-router-pre-softmax), the release's RoPE on a
      quarter of each head;
    * Qwen3.5-MoE: layer_types full, linear, linear, full (megatron's every-N rule cannot say it: the 0/1
      list), MoE on every layer, tied embeddings, RoPE on half of each head (its mrope is plain RoPE for text)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    shared = dict(vocab_size=384, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256)
    if family == "qwen3_next":
        return Qwen3NextConfig(intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
                               full_attention_interval=2, tie_word_embeddings=False, **shared)
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return Qwen3_5MoeTextConfig(layer_types=types, tie_word_embeddings=True, rope_parameters=rope, **shared)


def _kimi_config(family):
    """Kimi-Linear's shape in miniature: KDA layers of 2 heads of 8 with a 4-tap conv beside NoPE MLA layers (4 heads,
    latent 16, q/k 8 + 4 unrotated dims, v 8), 8 experts (top 2, sigmoid with the correction bias, renormalized and
    scaled) with shared experts.
    * kimi_linear: the release's layout: no q-LoRA, rms_norm_eps 1e-5 (the latent norm keeps 1e-6: the import scales
      its input), KDA and MLA alternating, a dense first layer, one shared expert, routed_scaling_factor 2.446;
    * kimi_linear_q_lora: q-LoRA (12), rms_norm_eps 1e-6, layers MLA, KDA, KDA, MLA (megatron's every-N rule cannot
      say it: the 0/1 list), MoE on every layer, 2 groups of 4 experts of which each token may use 1 (ranked by
      their top-2 sum), two shared experts."""
    from transformers import KimiLinearConfig

    shared = dict(vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, linear_num_heads=2,
                  linear_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "kimi_linear":
        return KimiLinearConfig(q_lora_rank=None, rms_norm_eps=1e-5, routed_scaling_factor=2.446, n_shared_experts=1,
                                layer_types=["linear_attention", "full_attention"] * 2,
                                mlp_layer_types=["dense"] + ["sparse"] * 3, **shared)
    return KimiLinearConfig(q_lora_rank=12, rms_norm_eps=1e-6, routed_scaling_factor=2.5, n_shared_experts=2, n_group=2,
                            topk_group=1, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                       "full_attention"], mlp_layer_types=["sparse"] * 4, **shared)


def tiny_hf(family, **config_changes):
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(family)
    for key, value in config_changes.items():
        setattr(config, key, value)
    # 5x transformers' init: attention logits of order 1, not 0.01, so that a wrong query or key row (a RoPE
    # permutation, a head order) moves the log-probs by far more than the 1e-4 the tests allow
    config.initializer_range = 0.1
    torch.manual_seed(3)
    return _perturbed(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), family)


def tiny_qwen3_5_moe_multimodal():
    """A Qwen3_5MoeForConditionalGeneration: the qwen3_5_moe language model (untied here, by the top-level
    tie_word_embeddings that transformers reads) beside a one-block vision tower."""
    import torch
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = _linear_config("qwen3_5_moe").to_dict()
    config = Qwen3_5MoeConfig(text_config=dict(text, initializer_range=0.1), tie_word_embeddings=False,
                              vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                                                 out_hidden_size=32, patch_size=4, num_position_embeddings=16))
    torch.manual_seed(3)
    return _perturbed(Qwen3_5MoeForConditionalGeneration(config).eval(), "qwen3_5_moe")


def _perturbed(model, family):
    import torch

    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("linear_attn.norm.weight"):
                # the gated norm's gain w itself (megatron stores w - 1): kept in [0.5, 2], where w - 1 is exact in
                # fp32 (Sterbenz), so that the export gives w back bit for bit
                p.add_(torch.randn_like(p) * 0.2).clamp_(0.5, 2.0)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("linear_attn.dt_bias"):  # ones at init: a dropped or shuffled dt_bias would not show
                p.add_(torch.randn_like(p) * 0.5)
            elif family == "kimi_linear" and name.endswith("kv_a_proj_with_mqa.weight"):
                # the latent c small (mean c^2 near 1e-6), so that the latent norm's eps (1e-6 in transformers,
                # rms_norm_eps = 1e-5 in megatron but for the import's scaling) moves the log-probs by far more
                # than 1e-4
                p[:model.config.kv_lora_rank].mul_(0.003)
            elif name.endswith("e_score_correction_bias"):  # zero at init: a dropped bias would not show
                p.copy_(torch.randn_like(p) * 0.3)
            elif family == "deepseek_v4" and name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn_like(p) * 0.5)  # zeros at init: a dropped or misplaced one would not show
            elif family == "deepseek_v4" and name.endswith(("_hc.scale", "hc_scale")):
                p.add_(torch.randn_like(p) * 0.3)
            elif family == "deepseek_v4" and name.endswith("tid2eid"):  # zeros at init: each token its own experts
                p.copy_(torch.rand(p.shape[0], model.config.n_routed_experts).argsort(-1)[:, :p.shape[1]])
            elif family == "gpt_oss" and name.endswith("sinks"):
                p.copy_(torch.randn_like(p))  # order 1 against the scores: the sink takes a real share
            elif family == "gpt_oss" and "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_quantized(model, directory, quantize_name, method, block=None, family_naming=None):
    """``model`` saved as a quantized release (the saved tensors named by ``quantize_name`` quantized), with
    config.json's quantization_config; returns the transformers model of the dequantized weights and them.
    ``family_naming`` "deepseek_v4": V4's release format (``X.scale``, UE8M0 scales, FP4 routed experts)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from cp_ext.hf import quantized as q

    plain = directory.with_name(directory.name + "_dequantized")
    model.save_pretrained(directory)  # the release's tensor names, then the weights replaced below
    saved = load_file(directory / "model.safetensors")
    tensors, dequantized = {}, {}
    for name, tensor in saved.items():
        if not quantize_name(name):
            tensors[name] = tensor
            continue
        if method == "fp8" and family_naming == "deepseek_v4":  # X.weight + X.scale; the routed experts FP4
            scale_name = name[:-len(q.WEIGHT)] + q.V4_SCALE
            if ".ffn.experts." in name:
                tensors[name], tensors[scale_name] = q.quantize_fp4_rows(tensor)
                dequantized[name] = q.dequantize_fp4_rows(tensors[name], tensors[scale_name])
            else:
                tensors[name], tensors[scale_name] = q.quantize_fp8_ue8m0(tensor, block)
                dequantized[name] = q.dequantize_fp8_blocks(tensors[name], tensors[scale_name], block)
        elif method == "fp8":
            weight, scale_inv = q.quantize_fp8_blocks(tensor, block)
            tensors[name], tensors[name + q.SCALE_INV] = weight, scale_inv
            dequantized[name] = q.dequantize_fp8_blocks(weight, scale_inv, block)
        else:
            blocks, scales = q.quantize_mxfp4(tensor)
            tensors[name + q.BLOCKS], tensors[name + q.SCALES] = blocks, scales
            dequantized[name] = q.dequantize_mxfp4(blocks, scales)
        assert not torch.equal(dequantized[name], tensor)  # quantizing changed it: the reference must follow
    assert dequantized
    shutil.copytree(directory, plain)
    save_file({**saved, **dequantized}, plain / "model.safetensors", metadata={"format": "pt"})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, **({"weight_block_size": list(block)} if block else {}),
                                     **({"scale_fmt": "ue8m0", "expert_dtype": "fp4"}
                                        if family_naming == "deepseek_v4" else {})}
    (directory / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32, attn_implementation="eager").eval()
    return reference, {**saved, **dequantized}


def v4_release_target(name):
    """What DeepSeek-V4's release quantizes: the attention's projections and the experts (the routed ones to FP4)."""
    return ".layers." in name and name.endswith(".weight") and any(
        f".{w}." in name for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3"))
