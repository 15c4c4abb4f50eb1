"""DeepSeek-V4's attention (``--experimental-attention-variant dsv4_hybrid``) trains the same model on every grid it
runs on: the whole model, through the trainer, against CP = 1 (fp32, 2 iterations).

The model is test_grid_equivalence's small MoE GPT with V4's attention in every layer: ``--csa-compress-ratios
[0,4,8,4,8]`` makes layer 1 sliding-window only, 2 and 4 CSA (blocks of 4, a 4-head indexer of dim 8 keeping each
query's top 2 entries) and 3 HCA (blocks of 8, ``--csa-compress-ratio-for-h 8``), and so is the MTP layer
(``--mtp-num-layers 1``, DeepSeek-V4's: per stream, its own stream head and norm; a kind unlike layer 1's, which
megatron-core 0.19 numbers it as), each PP2 stage holding a CSA layer; a window of 8, one K=V head of 16 with 4
channels rotated (V4's RoPE: 160000 on the compressed layers), q-LoRA of rank 12, sinks, a grouped output projection
of 2 groups of rank 8, and V4's hyper-connections (4 residual streams, 20 Sinkhorn iterations; between PP stages the
streams travel as 4 rows per token), and V4's MoE: the sqrtsoftplus router with an expert bias and a routed scale of
1.5, layer 1 hash-routed by its frozen token -> experts table (on every grid each token must meet its own id: TP2+SP
splits the ids with the tokens, PP2's second stage routes by the ids the model hands it), SwiGLU clamped at 1 (the
test's activations reach it). 32 tokens per sample: at CP4 zigzag each rank holds two 4-token chunks, shorter than
the window and than an HCA block, so the halo comes from several ranks and blocks straddle shards.

Compared, as in test_grid_equivalence (`_assert_same`): lm loss, MTP loss, load-balancing loss and grad norm of
both iterations to 1e-5 relative, and every parameter's gradient after iteration 1 (the q-LoRA, K=V head, sinks, grouped
output and the compressors'), reassembled from the ranks' slices through the checkpoint map. The indexer gets no
gradient from the main loss (transformers' V4 neither). Grids: CP2 ring (zigzag, contiguous), CP2 with
``--cp-comm-type all_gather`` (V4's layers run their own exchange whatever the type), CP4, Ulysses 2 x
ring 2 (the layers run their exchange over the whole CP group), TP2+SP, TP2+SP x CP2, PP2 x CP2, EP2 x CP2, full
recompute, and packed documents (``--reset-attention-mask``: windows and blocks stop at document ends) at CP1,
CP2 and CP4; and the model with ``--csa-dense-mode --csa-no-attention-sink`` (no indexer, no sinks) at CP4.
At CP = 1 the worker records the smallest relative gap between a query's k-th and (k+1)-th indexer
scores, which must exceed 1e-4 (exact zeros tie alike on every layout and are not gaps). Launches: 1, 2 and 4 ranks.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import worker_args, write_results  # noqa: E402
from tests.training.test_grid_equivalence import DOC_FLAGS, MODEL, _assert_same, _train, launch_layouts  # noqa: E402

V4 = ["--multi-latent-attention", "--qk-layernorm", "--num-query-groups", "4", "--q-lora-rank", "12", "--v-head-dim", "16",
      "--qk-pos-emb-head-dim", "4", "--experimental-attention-variant", "dsv4_hybrid",
      "--csa-compress-ratios", "[0,4,8,4,8]", "--csa-compress-ratio-for-h", "8", "--csa-window-size", "8",
      "--csa-compress-rotary-base", "160000", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "8",
      "--dsa-indexer-topk", "2", "--o-groups", "2", "--o-lora-rank", "8", "--init-method-std", "0.2",
      "--enable-hyper-connections", "--num-residual-streams", "4", "--mhc-sinkhorn-iterations", "20",
      "--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias",
      "--moe-router-topk-scaling-factor", "1.5", "--moe-n-hash-layers", "1", "--moe-router-load-balancing-type", "none",
      "--moe-aux-loss-coeff", "0", "--activation-func-clamp-value", "1.0", "--mtp-num-layers", "1"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
TP2SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
GRIDS = {  # name: (ranks, flags)
    "cp2_ring": (2, CP2),
    "cp2_ring_contiguous": (2, CP2 + ["--cp-load-balance", "none"]),
    "cp2_all_gather": (2, CP2 + ["--cp-comm-type", "all_gather"]),
    "cp2_recompute": (2, CP2 + RECOMPUTE),
    "cp4_ring": (4, CP4),
    "cp4_u2r2": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
    "tp2sp": (2, TP2SP),
    "tp2sp_cp2": (4, TP2SP + CP2),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2"] + CP2),
    "ep2_cp2": (4, ["--expert-model-parallel-size", "2"] + CP2),
}
RUNS = {"cp1": (1, [], None), "cp1_docs": (1, DOC_FLAGS, None), "cp1_corpus": (1, [], None)}
for _name, (_ranks, _flags) in GRIDS.items():
    RUNS[_name] = (_ranks, _flags, "cp1")
RUNS["cp2_ring_docs"] = (2, CP2 + DOC_FLAGS, "cp1_docs")
RUNS["cp4_ring_docs"] = (4, CP4 + DOC_FLAGS, "cp1_docs")
# CSA without its indexer (every complete entry read) and no sinks: a model of its own, exact at CP4 too
PLAIN = ["--csa-dense-mode", "--csa-no-attention-sink"]
RUNS["cp1_dense_no_sink"] = (1, PLAIN, None)
RUNS["cp4_ring_dense_no_sink"] = (4, CP4 + PLAIN, "cp1_dense_no_sink")
QUICK = ("cp2_ring",)
# The final stream collapse's scale and the router's gate: each gradient entry sums every token's term, terms that
# largely cancel, so its fp32 rounding is relative to the terms, not to the (small) sum, and the grids sum in
# different orders (measured: 3.9e-9 and 1.8e-9 absolute, 3e-8 of the largest gradient, at CP2 and EP2 x CP2).
TOLERANCES = {"hc_head.mix_scale": 5e-5, "mlp.router.weight": 5e-5}


def _flags(name, docs=None):
    """``docs``: the short-documents corpus (tests/conftest.py), which the packed-document runs read. The dense-mode
    runs build no indexer, so they take none of its sizes."""
    model = V4
    if "--csa-dense-mode" in RUNS[name][1]:
        i = V4.index("--dsa-indexer-n-heads")
        model = V4[:i] + V4[i + 6:]
    return MODEL + model + RUNS[name][1] + (["--data-path", docs] if name.endswith(("_docs", "_corpus")) else [])


def _recording_gaps(record):
    """`select_entries` that records, per call, the smallest relative gap between a query's k-th and (k+1)-th
    indexer scores where both exist and are not an exact-zero tie (those tie alike everywhere)."""
    import torch

    from cp_ext.attention.compressed import context_parallel as cp
    from cp_ext.attention.dsa.indexer import index_scores

    original = cp.select_entries

    def select(q, w, keys, key_positions, key_docs, q_positions, q_docs, topk, *args):
        scores = index_scores(q[None], w[None], keys[None])[0]
        readable = (key_positions[None, :] <= q_positions[:, None]) & (key_docs[None, :] == q_docs[:, None])
        ranked = scores.masked_fill(~readable, float("-inf")).sort(dim=-1, descending=True).values
        if ranked.shape[1] > topk:
            kth, nxt = ranked[:, topk - 1], ranked[:, topk]
            has = torch.isfinite(nxt) & (kth != 0)
            if has.any():
                record.append(((kth - nxt).abs() / torch.maximum(kth.abs(), nxt.abs()))[has].min().item())
        return original(q, w, keys, key_positions, key_docs, q_positions, q_docs, topk, *args)

    return cp, original, select


# ----------------------------------------------------------------------------- worker
def worker():
    import os

    import torch
    import torch.distributed as dist

    from cp_ext.transformer.router import DeepSeekV4Router

    opts = worker_args(sys.argv[1:], required=["--layouts", "--docs"])
    results = {"results_dir": opts.results_dir}
    real_set_layer_number = DeepSeekV4Router.set_layer_number
    for name in opts.layouts.split(","):
        gaps, routers = [], set()

        def set_layer_number(router, number):  # which layers this rank's routers are, and which route by hash
            real_set_layer_number(router, number)
            routers.add((number, router.is_hash))

        DeepSeekV4Router.set_layer_number = set_layer_number
        module, original, recording = _recording_gaps(gaps)
        module.select_entries = recording
        try:
            results[name], grads = _train(name, _flags(name, opts.docs))
        finally:
            module.select_entries = original
            DeepSeekV4Router.set_layer_number = real_set_layer_number
        results[name]["min topk gap"] = min(gaps) if gaps else None
        results[name]["routers"] = sorted(routers)
        torch.save(grads, Path(opts.results_dir, f"grads_{name}_rank{os.environ['RANK']}.pt"))
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def runs(quick, short_documents):
    """``runs(name)``: (rank 0's metrics, full gradients); one launch per world size."""
    done = {}

    def get(name):
        world = RUNS[name][0]
        if name not in done:
            wanted = [name] if quick else [n for n, (size, _, _) in RUNS.items() if size == world]
            done.update(launch_layouts(__file__, world, wanted, timeout=1200, extra=("--docs", short_documents)))
        return done[name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.quick] if n in QUICK else [])
                                    for n, (_, _, ref) in RUNS.items() if ref])
def test_v4_matches_cp1(layout, runs):
    reference, result = runs(RUNS[layout][2]), runs(layout)
    plain = "--csa-dense-mode" in RUNS[layout][1]
    if not plain:
        assert reference[0]["min topk gap"] > 1e-4, reference[0]["min topk gap"]
    _assert_same(result, reference, TOLERANCES, no_main_loss_grad=(".indexer.",))
    attention = [u for u in reference[1] if ".self_attention." in u and ".indexer." not in u]
    parts = {u.split(".self_attention.")[1].split(".")[0] for u in attention}
    assert parts == {"linear_q_down_proj", "q_down_norm", "linear_q_up_proj", "linear_kv_proj", "kv_layernorm",
                     "linear_o_group_proj", "linear_proj", "compressor"} | (set() if plain else {"sinks"}), parts
    assert all(reference[1][u].abs().max() > 0 for u in attention), "every attention parameter learns"
    mixing = [u for u in reference[1] if "_hc." in u or ".hc_head." in u]
    assert {u.split(".")[3] for u in mixing if u.startswith("decoder.")} == {"attn_hc", "ffn_hc", "hc_head"}, mixing
    assert {u.rsplit(".", 1)[0] for u in mixing if u.startswith("mtp.")} == {
        "mtp.layers.0.transformer_layer.attn_hc", "mtp.layers.0.transformer_layer.ffn_hc", "mtp.layers.0.hc_head"}
    assert all(reference[1][u].abs().max() > 0 for u in mixing), "every hyper-connection parameter learns"


def test_mtp_reads_the_streams(runs):
    """DeepSeek-V4's MTP (--mtp-num-layers 1, its layer HCA: the 5th ratio): a loss of its own, and every MTP
    parameter learns: enorm, hnorm and eh_proj (per stream), the layer's attention (a compressor, no indexer), mixings
    and MoE (learned routing), its own stream head and final norm; the decoder's head and final norm are applied
    after it read the streams."""
    metrics, grads = runs("cp1")
    assert metrics["mtp_1 loss"][0] > 0
    mtp = {u: g for u, g in grads.items() if u.startswith("mtp.")}
    for part in ("enorm", "hnorm", "eh_proj", "final_layernorm", "hc_head", "transformer_layer.self_attention.sinks",
                 "transformer_layer.mlp.router"):
        assert any(f"mtp.layers.0.{part}" in u for u in mtp), part
    assert any(".self_attention.compressor." in u for u in mtp) and not any(".indexer." in u for u in mtp)  # HCA
    assert all(g.abs().max() > 0 for g in mtp.values()), [u for u, g in mtp.items() if not g.abs().max() > 0]
    assert grads["decoder.final_layernorm.weight"].abs().max() > 0
    assert grads["decoder.layers.3.hc_head.mix_weight"].abs().max() > 0


def test_layer_kinds_and_the_indexer(runs):
    """Layers 2 and 4 hold a compressor and an indexer (CSA), layer 3 a compressor (HCA), layer 1 neither; the
    indexer takes no gradient from the main loss."""
    grads = runs("cp1")[1]  # units: decoder.layers.<0-based layer>.<parameter> (V4's layers are keyed one by one)
    decoder = [u for u in grads if u.startswith("decoder.")]
    compressors = sorted({u.split(".")[2] for u in decoder if ".self_attention.compressor." in u})
    indexers = sorted({u.split(".")[2] for u in decoder if ".self_attention.indexer." in u})
    assert compressors == ["1", "2", "3"] and indexers == ["1", "3"], (compressors, indexers)
    assert all(grads[u].abs().max() == 0 for u in grads if ".indexer." in u)


def test_dense_mode_and_no_sinks_change_the_model(runs):
    """--csa-dense-mode builds no indexer and --csa-no-attention-sink no sinks, and the loss is another model's."""
    plain, full = runs("cp1_dense_no_sink"), runs("cp1")
    assert not any(".indexer." in u or ".sinks" in u for u in plain[1])
    assert abs(plain[0]["lm loss"][0] - full[0]["lm loss"][0]) > 1e-3 * full[0]["lm loss"][0]


def test_v4_routers(runs):
    """Every MoE layer routes with cp_ext's V4 router; only layer 1 (--moe-n-hash-layers 1) by its hash table."""
    assert runs("cp1")[0]["routers"] == [[1, True], [2, False], [3, False], [4, False], [5, False]]  # 5: MTP's


def test_documents_reach_the_layers(runs):
    """On the short-documents corpus --reset-attention-mask changes the loss: V4's windows, blocks and positions
    stop at the documents' ends (and the CP layouts equal CP = 1's there: test_v4_matches_cp1)."""
    plain, docs = runs("cp1_corpus")[0]["lm loss"][0], runs("cp1_docs")[0]["lm loss"][0]
    assert abs(plain - docs) > 1e-3 * abs(plain), (plain, docs)


if __name__ == "__main__":
    worker()
