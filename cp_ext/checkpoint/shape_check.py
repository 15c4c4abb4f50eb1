"""A checkpoint of another model, caught before any tensor is read: each tensor whose global shape differs
from the checkpoint's, named with the flags that set it."""

# Which flags decide the shape of a tensor, by the tensor's checkpoint key: a mismatch names them.
_SHAPE_FLAGS_BY_KEY = (
    ("position_embeddings", "--max-position-embeddings (default: --seq-length)"),
    ("word_embeddings", "--padded-vocab-size, --vocab-size or the tokenizer, --make-vocab-size-divisible-by"),
    ("output_layer", "--padded-vocab-size, --vocab-size or the tokenizer, --make-vocab-size-divisible-by"),
    ("router", "--num-experts, --hidden-size"),
    ("shared_experts", "--moe-shared-expert-intermediate-size, --hidden-size, --swiglu"),
    ("experts", "--num-experts, --moe-ffn-hidden-size, --hidden-size, --swiglu"),
    ("linear_fc", "--ffn-hidden-size, --hidden-size, --swiglu"),
    ("linear_qkv", "--num-attention-heads, --num-query-groups, --kv-channels, --hidden-size, --attention-output-gate"),
    ("self_attention.in_proj", "--linear-num-key-heads, --linear-num-value-heads, --linear-key-head-dim, "
                               "--linear-value-head-dim, --hidden-size"),
    ("self_attention.conv1d", "--linear-conv-kernel-dim, --linear-num-key-heads, --linear-num-value-heads, "
                              "--linear-key-head-dim, --linear-value-head-dim"),
    ("self_attention.out_proj", "--linear-num-value-heads, --linear-value-head-dim, --hidden-size"),
    ("self_attention.out_norm", "--linear-value-head-dim"),
    ("A_log", "--linear-num-value-heads"),
    ("dt_bias", "--linear-num-value-heads"),
    ("linear_q", "--num-attention-heads, --hidden-size, --q-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim"),
    ("linear_kv", "--kv-lora-rank, --qk-head-dim, --v-head-dim, --num-attention-heads"),
    ("linear_proj", "--num-attention-heads, --kv-channels, --v-head-dim, --hidden-size"),
    ("layernorm", "--hidden-size, --kv-channels, --normalization"),
)


def shape_mismatches(model_request, saved_tensors):
    """Each model tensor whose global shape here differs from the checkpoint's: key, both shapes, the flags."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for t in nested_values(model_request):
        if not isinstance(t, ShardedTensor) or t.key not in saved_tensors or t.key in out:
            continue
        here, there = tuple(t.global_shape), tuple(saved_tensors[t.key].global_shape)
        if here != there:
            flags = next((f for part, f in _SHAPE_FLAGS_BY_KEY if part in t.key), "the model flags")
            out[t.key] = f"{t.key}: {list(there)} in the checkpoint, {list(here)} here (set by {flags})"
    return list(out.values())
