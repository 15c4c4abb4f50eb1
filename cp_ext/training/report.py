"""The lines a run prints at startup: which attention kernel runs and what CP exchanges, and the grid
the loop trains on. Rank 0 prints them (`cp_ext.console.print_rank_0`); tests read them."""

from megatron.core.transformer.utils import is_layer_window_attention

from cp_ext.attention.kernels import choose_kernel, dtype_name
from cp_ext.transformer.mla import latent_possible, takes_latent


def training_line(args, world_size, dp_size, num_microbatches, device, rank_0_params):
    """The grid, microbatches, device and parameter count the loop trains with."""
    return (f"training: world {world_size} = TP {args.tensor_model_parallel_size} x "
            f"PP {args.pipeline_model_parallel_size} x CP {args.context_parallel_size} "
            f"({_cp_attention(args)}) x DP {dp_size} "
            f"(EP {args.expert_model_parallel_size}), {num_microbatches} microbatches/iteration, "
            f"device {device.type}, {rank_0_params} params on rank 0")


def attention_kernel_line(config, device):
    """The startup line saying which local attention kernel runs (what ``auto`` picked)."""
    if getattr(config, "dsv4_layer_kinds", None):
        return _deepseek_v4_line(config)
    kernel, head_dim = config.attention_kernel, config.kv_channels
    window = getattr(config, "window_size", None)
    mla = getattr(config, "multi_latent_attention", False)
    v_dim = None
    if mla:  # MLA's own head dims: q/k = qk_head_dim + the RoPE part, v its own
        head_dim, v_dim = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    dims = f"head dim {head_dim}" if v_dim is None else f"q/k head dim {head_dim}, v {v_dim}"
    what = f"({dtype_name(config.params_dtype)}, {dims}, {device.type})"
    extras = (_dsa_note(config) if getattr(config, "dsa", False) else _mla_exchange_note(config)) if mla else ""
    if window is not None:  # which layers megatron's rule windows, 1-based as megatron counts them
        layers = [n for n in range(1, config.num_layers + 1)
                  if is_layer_window_attention(window, config.window_attn_skip_freq, n)]
        extras += f"; window {window[0]},{window[1]} on layers {layers}"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        extras += f"; attention sink {config.softmax_type} (added after the LSE merge, any kernel)"
    if kernel != "auto":
        return f"attention: kernel {kernel} {what}{extras}"
    choice = choose_kernel(device.type, config.params_dtype, head_dim, window=window is not None, v_head_dim=v_dim)
    line = f"attention: --attention-backend auto picks kernel {choice} {what}{extras}"
    if config.context_parallel_size == 1 and not extras:  # CoreAttention keeps F.sdpa there
        line += "; at CP = 1 outside CP-aware recompute, torch's F.scaled_dot_product_attention picks its own"
    return line


def _deepseek_v4_line(config):
    """DeepSeek-V4's layers: their kinds, the window, and what crosses CP ranks (`cp_ext.attention.compressed`)."""
    kinds, mtp = config.dsv4_layer_kinds[:config.num_layers], config.dsv4_layer_kinds[config.num_layers:]
    counts = ", ".join(f"{kinds.count(k)} {name}" for k, name in (("sliding", "sliding"), ("csa", "CSA"),
                                                                  ("hca", "HCA")) if k in kinds)
    if mtp:
        counts += f"; MTP: {', '.join(mtp)}"
    csa = ("every complete entry (dense mode)" if config.csa_dense_mode else
           f"its top-{config.dsa_indexer_topk} entries by a {config.dsa_indexer_n_heads}-head indexer")
    cp = ("" if config.context_parallel_size == 1 else
          f"; CP sends each shard's window halo ({config.csa_window_size - 1} tokens of {config.v_head_dim} values) "
          f"and the compressed entries, never the query heads")
    return (f"attention: DeepSeek-V4 ({counts}; window {config.csa_window_size}; CSA blocks of "
            f"{config.csa_compress_ratio_for_c} read {csa}; HCA blocks of {config.csa_compress_ratio_for_h}; "
            f"{'sinks' if config.csa_attention_sink else 'no sinks'}; torch, {dtype_name(config.params_dtype)}){cp}")


def _dsa_note(config):
    """DeepSeek sparse attention: its sizes, what CP exchanges, and whether the indexer trains."""
    latent = config.kv_lora_rank + config.qk_pos_emb_head_dim + config.dsa_indexer_head_dim
    cp = ("" if config.context_parallel_size == 1 else
          f"; CP exchanges the latent and the indexer key, {latent} values per token")
    loss = (f"indexer loss x {config.dsa_indexer_loss_coeff:g} over "
            f"{'the selected keys' if config.dsa_indexer_use_sparse_loss else 'every causal key'}"
            if config.dsa_indexer_loss_coeff else "no indexer loss")
    if getattr(config, "dsa_dense_warmup", False):
        return (f"; DeepSeek sparse attention, dense warm-up: attention over every key, only the "
                f"{config.dsa_indexer_n_heads}-head indexer trains ({loss}){cp}")
    return (f"; DeepSeek sparse attention: each query attends to its top-{config.dsa_indexer_topk} keys by a "
            f"{config.dsa_indexer_n_heads}-head indexer (head dim {config.dsa_indexer_head_dim}), {loss}{cp}")


def _mla_exchange_note(config):
    """What MLA's ring / all-gather send per token, per layer as the layers resolve ``--cp-mla-exchange``."""
    if config.context_parallel_size == 1:
        return "; multi-latent attention (no CP exchange at CP = 1)"
    heads = config.num_attention_heads // config.tensor_model_parallel_size
    kv = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim)
    latent = config.kv_lora_rank + config.qk_pos_emb_head_dim
    types = config.cp_comm_types or [None] * config.num_layers
    takes = [takes_latent(config.cp_mla_exchange, latent_possible(config.context_parallel_size, t == "all_gather",
                                                                  config.ulysses_size,
                                                                  config.tensor_model_parallel_size), config, heads)
             for t in types]
    on = "every layer" if all(takes) else f"layers {[n + 1 for n, t in enumerate(takes) if t]}" if any(takes) else None
    if on is None:
        return f"; multi-latent attention: CP exchanges per-head K/V, {kv} values per token (--cp-mla-exchange " \
               f"{config.cp_mla_exchange})"
    return (f"; multi-latent attention: CP exchanges the latent on {on}, {latent} values per token instead of "
            f"{kv} (--cp-mla-exchange {config.cp_mla_exchange})")


def _cp_attention(args):
    """How CP attention runs, for the startup line: the groups, all-gather layers, packed documents."""
    text = f"Ulysses {args.ulysses_size} x ring {args.context_parallel_size // args.ulysses_size}"
    if args.cp_comm_types and args.context_parallel_size > 1:
        n = args.cp_comm_types.count("all_gather")
        text = "all_gather" if n == len(args.cp_comm_types) else f"{text}; all_gather in {n} of {len(args.cp_comm_types)} layers"
    if args.reset_attention_mask:
        text += "; attention within documents"
    return text
