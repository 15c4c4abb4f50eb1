"""Small random Hugging Face models, built with transformers' own config classes (no hub), one per
family that tools/convert_hf.py imports; their norms are perturbed so a dropped norm shows.
`SHARDS`: how each is saved (sharded with an index at that size, or one file)."""

SHARDS = {"qwen3_moe": "40KB", "mixtral": None, "gpt_oss": "40KB"}


def tiny_gpt_oss():
    """GPT-OSS's release shape at toy size: alternating sliding (8 keys, so a 62-token prompt passes it) and
    full layers, the release's YaRN (factor 32 from 4096 positions, beta 32/1, truncate false; head dim 8
    puts the ramp across the frequencies), biases and sinks. Weights at std 0.1 (not 0.02) and a clamp of
    1.0 (not 7) so the attention is not flat and the clamp bites; every bias and sink random and non-zero
    (transformers initializes most biases to 0), so a dropped window, sink, bias or clamp moves the
    log-probs (tests/tools/test_convert_hf.py measures by how much)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = GptOssConfig(vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=32 * 4096,
                          rope_parameters=yarn, initializer_range=0.1, swiglu_limit=1.0,
                          # transformers' readable eager paths (the sinks need eager attention on CPU)
                          attn_implementation="eager", experts_implementation="eager")
    return GptOssForCausalLM(config)


def tiny_hf(family):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                max_position_embeddings=128, tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(config)
    elif family == "mixtral":
        config = MixtralConfig(vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=128)
        model = MixtralForCausalLM(config)
    else:
        model = tiny_gpt_oss()
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif family == "gpt_oss" and name.endswith("sinks"):
                p.copy_(torch.randn_like(p))  # order 1 against the scores: the sink takes a real share
            elif family == "gpt_oss" and "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model
