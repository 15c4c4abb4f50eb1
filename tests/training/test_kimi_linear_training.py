"""A Kimi-Linear-shaped hybrid (``--experimental-attention-variant kda`` with NoPE multi-latent attention) trains the
same model on every grid it runs on: the whole model, through the trainer, against CP = 1 (fp32, 2 iterations).

The model is test_grid_equivalence's small MoE GPT made Kimi-Linear: 4 layers, ``--linear-attention-freq 2`` (layers
1 and 3 Kimi Delta Attention, 2 and 4 multi-latent attention, so each PP2 stage holds both), KDA with 2 heads of 8
and a 4-tap conv, MLA without q-LoRA and without RoPE (``--no-rope-freq 1``: its 4-dim shared key part unrotated),
a dense first layer (``--moe-layer-freq [0,1,1,1]``), a sigmoid router with expert bias and a scaled top-k, and a
shared expert. Packed documents throughout (``--reset-attention-mask --eod-mask-loss``: the KDA state and conv
restart at every document, MLA attends within it), 64 tokens per sample: at CP4 zigzag each rank holds two 8-token
segments, so the conv's 3-token halo and the state cross every segment boundary.

Compared, as in test_linear_attention_training (`_assert_same`): lm loss, load-balancing loss and grad norm of both
iterations to 1e-5 relative, and every parameter's gradient after iteration 1 (KDA's in_proj and conv sections, its
low-rank gates, beta, A_log, dt_bias, gated norm and out_proj; MLA's projections and latent norm; the router, shared
expert and the dense layer), reassembled from the ranks' slices through the checkpoint map. Grids: CP2 ring, CP4
ring, TP2+SP x CP2, PP2 x CP2. Launches: 1, 2 and 4 ranks.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import worker_args, write_results  # noqa: E402
from tests.training.test_grid_equivalence import MODEL, LinearLayerWatch, _assert_same, _train, launch_layouts  # noqa: E402

KIMI_LINEAR = ["--experimental-attention-variant", "kda", "--linear-attention-freq", "2",
               "--linear-num-key-heads", "2", "--linear-num-value-heads", "2", "--linear-key-head-dim", "8",
               "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
               "--multi-latent-attention", "--num-query-groups", "4", "--kv-lora-rank", "16", "--qk-head-dim", "8",
               "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--position-embedding-type",
               "none", "--rope-type", "rope", "--no-rope-freq", "1",
               "--moe-layer-freq", "[0,1,1,1]", "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.1",
               "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "32",
               "--seq-length", "64", "--max-position-embeddings", "64", "--init-method-std", "0.1"]
# Packed documents without --reset-position-ids: cp_ext's MLA refuses it (its RoPE takes no per-batch positions), and a
# NoPE model has no positions to reset.
DOCUMENTS = ["--reset-attention-mask", "--eod-mask-loss"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
RUNS = {  # name: (ranks, flags, the CP = 1 run it equals)
    "cp1_docs": (1, [], None),
    "cp2_ring_docs": (2, CP2, "cp1_docs"),
    "cp4_ring_docs": (4, CP4, "cp1_docs"),
    "tp2sp_cp2_docs": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + CP2, "cp1_docs"),
    "pp2_cp2_docs": (4, ["--pipeline-model-parallel-size", "2"] + CP2, "cp1_docs"),
    # the KDA layers' all-to-all before their conv, state passing over the ring of 2
    "cp4_u2r2_docs": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
                      "cp1_docs"),
    "ep2_cp2_docs": (4, ["--expert-model-parallel-size", "2"] + CP2, "cp1_docs"),
    # CP-aware full recompute: the KDA layers replay their first forward's gathers
    "cp2_recompute_docs": (2, CP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"], "cp1_docs"),
}
QUICK = ("cp2_ring_docs",)
# --no-rope-freq on megatron's own softmax attention (its SelfAttention reads no_rope_freq): every layer without RoPE
# is the model without position embedding (one process, with the CP = 1 launch)
SOFTMAX = {"softmax_no_rope_freq": MODEL + ["--no-rope-freq", "1"],
           "softmax_position_none": MODEL + ["--position-embedding-type", "none"]}
# dt_bias and A_log: each gradient entry sums one head's (channel's) terms over every token of the batch, terms that
# largely cancel, so the sum's fp32 rounding is relative to the terms (as Gated DeltaNet's: 5e-5).
TOLERANCES = {".dt_bias": 5e-5, ".A_log": 5e-5}
KDA_PARTS = {"in_proj", "conv1d", "f_a_proj", "f_b_proj", "beta_proj", "g_a_proj", "g_b_proj", "A_log", "dt_bias",
             "out_norm", "out_proj"}


def _flags(name):
    return SOFTMAX[name] if name in SOFTMAX else MODEL + KIMI_LINEAR + DOCUMENTS + RUNS[name][1]


# ----------------------------------------------------------------------------- worker
def worker():
    import os

    import torch
    import torch.distributed as dist

    from cp_ext.transformer.kimi_delta_attention import KimiDeltaAttention
    from cp_ext.transformer.mla import ContextParallelMLASelfAttention

    opts = worker_args(sys.argv[1:], required=["--layouts"])
    results = {"results_dir": opts.results_dir}
    mla_layers = []
    real_mla_init = ContextParallelMLASelfAttention.__init__

    def mla_init(self, *a, **kw):  # which layers are MLA, and whether they rotate
        real_mla_init(self, *a, **kw)
        mla_layers.append((self.layer_number, self.no_rope))

    ContextParallelMLASelfAttention.__init__ = mla_init
    try:
        with LinearLayerWatch(KimiDeltaAttention) as watch:
            for name in opts.layouts.split(","):
                watch.reset(), mla_layers.clear()
                results[name], grads = _train(name, _flags(name))
                results[name].update(watch.record("kda"))
                results[name]["mla layers (number, no rope)"] = sorted(set(mla_layers))
                torch.save(grads, Path(opts.results_dir, f"grads_{name}_rank{os.environ['RANK']}.pt"))
    finally:
        ContextParallelMLASelfAttention.__init__ = real_mla_init
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def runs(quick):
    """``runs(name)``: (rank 0's metrics, full gradients); one launch per world size."""
    done = {}

    def get(name):
        world = 1 if name in SOFTMAX else RUNS[name][0]
        if name not in done:
            wanted = [name] if quick else [n for n, (size, _, _) in RUNS.items() if size == world] + (
                list(SOFTMAX) if world == 1 else [])
            done.update(launch_layouts(__file__, world, wanted, timeout=1200))
        return done[name]

    return get


def test_cp_aware_recompute_replays_the_kda_layers_exchanges(runs):
    """Full recompute at CP2: each KDA layer's recompute replays its first forward's gathers (2 iterations x 4
    microbatches x 2 KDA layers), and the run equals CP1 (test_kimi_linear_matches_cp1[cp2_recompute_docs])."""
    assert runs("cp2_recompute_docs")[0]["kda replayed"] == 16 and runs("cp2_ring_docs")[0]["kda replayed"] == 0


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.quick] if n in QUICK else [])
                                    for n, (_, _, ref) in RUNS.items() if ref])
def test_kimi_linear_matches_cp1(layout, runs):
    reference, result = runs(RUNS[layout][2]), runs(layout)
    _assert_same(result, reference, TOLERANCES)
    kda = [u for u in reference[1] if ".self_attention." in u and u.split(".self_attention.")[1].split(".")[0]
           in KDA_PARTS]
    assert {u.split(".self_attention.")[1].split(".")[0] for u in kda} == KDA_PARTS
    assert all(reference[1][u].abs().max() > 0 for u in kda), "every KDA parameter learns"


def test_pattern_builds_kda_and_nope_mla(runs):
    """--linear-attention-freq 2: layers 1 and 3 (megatron's 1-based numbers) are KDA, 2 and 4 multi-latent attention
    without RoPE; the checkpoint map splits in_proj and conv1d into Megatron-LM's query / key / value sections; the
    dense first layer has no router; documents reach every KDA forward."""
    run, grads = runs("cp1_docs")
    assert run["kda layers"] == [1, 3]
    assert run["mla layers (number, no rope)"] == [[2, True], [4, True]]
    assert run["kda forwards with documents"] == [True]
    for name in ("in_proj", "conv1d"):
        sections = sorted({u.split(f"{name}.weight.")[1].split(".")[0] for u in grads if f"{name}.weight." in u})
        assert sections == ["key", "query", "value"], (name, sections)
    routers = sorted(int(u.split("decoder.layers.")[1].split(".")[0]) for u in grads if u.endswith("mlp.router.weight"))
    assert routers == [1, 2, 3], routers  # 0-based layer indices: layer 1 (index 0) is dense


def test_no_rope_freq_on_softmax_attention_is_no_position_embedding(runs):
    """--no-rope-freq 1 on megatron's softmax attention: the same losses and gradients as
    --position-embedding-type none (the RoPE the model computes is not applied)."""
    _assert_same(runs("softmax_no_rope_freq"), runs("softmax_position_none"))


if __name__ == "__main__":
    worker()
