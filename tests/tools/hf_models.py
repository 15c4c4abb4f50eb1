"""Small random Hugging Face models, built with transformers' own config classes (no hub), one per
family that tools/convert_hf.py imports; their norms are perturbed so a dropped norm shows.
`SHARDS`: how each is saved (sharded with an index at that size, or one file)."""

SHARDS = {"qwen3_moe": "40KB", "mixtral": None}


def tiny_hf(family):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if family == "qwen3_moe":
        config = Qwen3MoeConfig(vocab_size=384, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                max_position_embeddings=128, tie_word_embeddings=False)
        model_class = Qwen3MoeForCausalLM
    else:
        config = MixtralConfig(vocab_size=384, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=128)
        model_class = MixtralForCausalLM
    torch.manual_seed(3)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model
