"""Same seed + same data => same model on every TP x PP x CP x DP x EP grid (fp32, 2-3 iterations).

Each layout trains 2 iterations of one small MoE GPT (3 with the distributed optimizer, whose
gradients are seen only through the losses: iteration 3 is the first update that reads the
sharded Adam moments). Compared against the
single-process run (TP1 PP1 DP1):
  * the global-batch lm loss, MoE load-balancing loss and grad norm of every
    iteration (relative 1e-5);
  * the full gradient of every parameter after iteration 1, reassembled from the
    ranks' slices through megatron's sharded_state_dict map.
The TP2+SP layout also checks the sequence-parallel norms: their gradients are only
right if megatron's finalize_model_grads sums them over TP. The CP layouts cover the
ring, Ulysses and the hybrid through the real model (RoPE at global positions, sharded
tokens and loss mask, the per-token loss over DP x CP), and a CP rank whose whole shard
is masked out. Megatron-LM's five MoE scripts (tests/families) run on every CP type and grid,
and megatron's alltoall dispatcher against the single-process allgather one. Multi-token prediction
(--mtp-num-layers) adds its mtp losses and evaluation's losses to the comparison, and one run with
megatron's own roll shows the comparison catches a wrong shift.

Every layout of one world size runs in one launch (1, 2, 4 and 8 ranks: four launches for 104
layouts), each on its own grid of the same ranks, one after another.
"""

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

from cp_ext.megatron_compat import MTP_REPEATED_LAYER
from tests.families import FAMILIES, tiny
from tests.launch import launch, worker_args, write_results

MODEL = [
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "11", "--clip-grad", "1.0",
]

LAYOUTS = {
    "tp1pp1dp1": (1, []),
    "tp2sp_dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "dp4_distopt": (4, ["--use-distributed-optimizer"]),
    "dp4_ep2": (4, ["--expert-model-parallel-size", "2"]),
    "tp2pp2dp2_ep2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    # context parallelism
    "cp2_ring": (2, ["--context-parallel-size", "2"]),
    "cp2_ring_contiguous": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--cp-load-balance", "none"]),
    "cp2_ulysses": (2, ["--context-parallel-size", "2", "--ulysses-size", "2"]),
    "cp4_ulysses2_ring2": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                          "--expert-model-parallel-size", "2"]),
}

# Loss mask zero on the second half of every sample: with contiguous CP2, rank 1 holds
# no token that counts, and must neither produce NaN nor skew the average.
MASK_SECOND_HALF = "--test-mask-second-half"
MASKED = {
    "cp1_masked": (1, [MASK_SECOND_HALF]),
    "cp2_contiguous_masked": (2, [MASK_SECOND_HALF, "--context-parallel-size", "2", "--cp-load-balance", "none"]),
}
LAYOUTS.update(MASKED)

# Packed documents (Megatron's --reset-attention-mask --reset-position-ids --eod-mask-loss) on a
# corpus of short documents (1-12 tokens: shorter than a CP4 zigzag chunk of 4, single-token
# ones, and ones spanning several ranks in a 32-token sample), against CP=1 with the same flags.
DOC_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
DOCUMENTS = {
    "cp1_docs": (1, []),
    "cp2_ring_docs": (2, ["--context-parallel-size", "2"]),
    "cp4_ulysses2_ring2_docs": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                    "--hierarchical-context-parallel-sizes", "2", "2"]),
    "cp2_all_gather_docs": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    # per-layer types: the U2 x R2 hybrid and all_gather layers on the same layout
    "cp4_hybrid_and_all_gather_docs": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                           "all_gather", "a2a+p2p", "all_gather",
                                           "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2_docs": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2_docs": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                               "2", "--expert-model-parallel-size", "2"]),
}
LAYOUTS.update({name: (n, flags + DOC_FLAGS) for name, (n, flags) in DOCUMENTS.items()})


# GPT-OSS's attention: a sliding window (5 tokens: wider than a CP4 zigzag chunk of 4) on layers 1
# and 3 of 4, and a learnable sink per head (a TP-sharded parameter at TP2), against CP=1 with the same flags.
WINDOW_FLAGS = ["--window-size", "5,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable"]
WINDOWS = {
    "cp1_window": (1, []),
    "cp2_ring_window": (2, ["--context-parallel-size", "2"]),
    "cp2_all_gather_window": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp4_ulysses2_ring2_window": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                      "--hierarchical-context-parallel-sizes", "2", "2"]),
    "tp2cp2dp2_ep2_window": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                                 "2", "--expert-model-parallel-size", "2"]),
}

# Qwen3's per-head q/k norms (--qk-layernorm), a replicated parameter seen by each TP rank's heads only.
QK_NORM = {
    "cp1_qknorm": (1, []),
    "cp2_ring_qknorm": (2, ["--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2_qknorm": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                                 "2", "--expert-model-parallel-size", "2"]),
}

# DeepSeek-V3's attention: multi-latent attention with q-LoRA, its latent norms (--qk-layernorm) and YaRN
# (Megatron-LM's flags), against CP=1.
# `auto` exchanges the latent on the ring and all-gather at TP 1 and per-head K/V elsewhere.
MLA_FLAGS = ["--multi-latent-attention", "--qk-layernorm", "--group-query-attention", "--num-query-groups", "4", "--q-lora-rank", "12", "--kv-lora-rank", "16",
             "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4",
             "--mscale-all-dim", "1.0"]
MLA = {
    "cp1_mla": (1, []),
    "cp2_ring_mla": (2, ["--context-parallel-size", "2"]),
    "cp2_ring_mla_kv": (2, ["--context-parallel-size", "2", "--cp-mla-exchange", "kv"]),
    "tp2sp_mla": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),  # MLA's own TP projections
    "cp2_all_gather_mla": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--cp-mla-exchange",
                               "latent"]),
    "cp4_ulysses2_ring2_mla": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                   "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2_mla": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    # full recompute, CP-aware: the latent ring's (out, LSE) kept, its backward replayed
    "cp2_ring_mla_recompute": (2, ["--context-parallel-size", "2", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "tp2cp2dp2_ep2_mla": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                              "2", "--expert-model-parallel-size", "2"]),
}
LATENT = {"cp2_ring_mla", "cp2_all_gather_mla", "pp2_cp2_mla", "cp2_ring_mla_recompute"}  # where the latent travels

# megatron's alltoall dispatcher (every script below uses it) on CPU/gloo through cp_ext.platform's shims,
# against the single-process allgather run: EP all-to-all, expert-TP's uneven gather/scatter, with PP and
# CP; and with shared experts overlapped on its communication (alltoall only, in megatron).
A2A = ["--moe-token-dispatcher-type", "alltoall"]
ALLTOALL = {
    "dp4_ep2_alltoall": (4, ["--expert-model-parallel-size", "2"]),
    "tp2sp_dp2_alltoall": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2pp2dp2_ep2_alltoall": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    "cp4_ulysses2_ring2_ep2_alltoall": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                            "--hierarchical-context-parallel-sizes", "2", "2",
                                            "--expert-model-parallel-size", "2"]),
    "tp2cp2dp2_ep2_alltoall": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                                   "2", "--expert-model-parallel-size", "2"]),
}
SHARED = ["--moe-shared-expert-intermediate-size", "24"]
SHARED_EXPERTS = {
    "cp1_shared": (1, []),
    "cp2_ring_ep2_shared_overlap": (2, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"] + A2A
                                    + ["--moe-shared-expert-overlap"]),
    "tp2cp2dp2_ep2_shared_overlap": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                         "--context-parallel-size", "2", "--expert-model-parallel-size", "2"] + A2A
                                     + ["--moe-shared-expert-overlap"]),
}

# Megatron-LM's own MoE scripts (tests/families: Mixtral, Qwen3-MoE, DeepSeek-V2-Lite, DeepSeek-R1 = V3's
# architecture, GPT-OSS), their flags unchanged at toy sizes and in fp32, on every CP type and grid.
FAMILY_LAYOUTS = {
    "cp1": (1, []),
    "cp2_ring": (2, ["--context-parallel-size", "2"]),
    "cp2_ulysses": (2, ["--context-parallel-size", "2", "--ulysses-size", "2"]),
    "cp2_all_gather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp2_recompute": (2, ["--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
                          "uniform", "--recompute-num-layers", "1"]),
    "cp4_ulysses2_ring2": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                          "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
}
FAMILY_RUNS = {f"{family}_{layout}": (family, layout) for family in FAMILIES for layout in FAMILY_LAYOUTS}
# GPT-OSS's biased experts at TP2 + SP x CP2: at expert-TP 2 (megatron's default, = TP; each fc2 bias added once
# over the expert-TP ranks), and at expert-TP 1 under TP 2 at EP 1 (every expert's gradients summed over
# megatron's expert-DP group, the TP peers; without it: grad norm 1.52535 against 1.52545 on MODEL)
TP2SP_CP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]
FAMILY_LAYOUTS.update({"tp2sp_cp2": (4, TP2SP_CP2),
                       "tp2sp_cp2_etp1": (4, TP2SP_CP2 + ["--expert-tensor-parallel-size", "1"])})
FAMILY_RUNS.update({f"gpt_oss_20b_{layout}": ("gpt_oss_20b", layout) for layout in ("tp2sp_cp2", "tp2sp_cp2_etp1")})


def family_args(family, layout_flags):
    """The family's script flags at toy sizes, fp32 (no --bf16: exactness is checked at fp32), on a layout."""
    tokens = [t for t in tiny(family) if t != "--bf16"]
    if "--recompute-granularity" in layout_flags:  # full recompute replaces the script's selective one
        tokens = [t for t in tokens if t not in ("--recompute-activations", "--moe-layer-recompute")]
    return tokens + layout_flags



# DeepSeek-V3's multi-token prediction: two depths (the second shifts twice across the CP shards), with
# Megatron-LM's default learned absolute positions (the rolled position ids pick the MTP embedding's rows)
# and LayerNorm, against CP=1; the lm and each depth's mtp loss compared too.
MTP_FLAGS = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--position-embedding-type",
             "learned_absolute", "--normalization", "LayerNorm"]
MTP = {
    "cp1_mtp": (1, []),
    "cp2_ring_mtp": (2, ["--context-parallel-size", "2"]),
    "cp2_ring_contiguous_mtp": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--cp-load-balance", "none"]),
    "cp2_ulysses_mtp": (2, ["--context-parallel-size", "2", "--ulysses-size", "2"]),
    "cp2_all_gather_mtp": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp4_ulysses2_ring2_mtp": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                   "--hierarchical-context-parallel-sizes", "2", "2"]),
    "tp2sp_cp2_mtp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2_mtp": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                              "--expert-model-parallel-size", "2"]),
    # megatron's MTP layer checkpoints itself; cp_ext's CP-aware recompute replays its attention too
    "cp2_ring_mtp_recompute": (2, ["--context-parallel-size", "2", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
}

UNMASKED_DOCS = "cp1_docs_unmasked"  # the documents corpus without the flags: they must matter
RUNS = {name: (n, flags, None) for name, (n, flags) in LAYOUTS.items() if name not in DOCUMENTS}
RUNS.update({name: (n, flags + DOC_FLAGS, "docs") for name, (n, flags) in DOCUMENTS.items()})
RUNS[UNMASKED_DOCS] = (1, [], "docs")
RUNS.update({name: (n, flags + WINDOW_FLAGS, None) for name, (n, flags) in WINDOWS.items()})
RUNS.update({name: (n, flags + MLA_FLAGS, None) for name, (n, flags) in MLA.items()})
RUNS.update({name: (n, flags + ["--qk-layernorm"], None) for name, (n, flags) in QK_NORM.items()})
RUNS.update({name: (n, flags + A2A, None) for name, (n, flags) in ALLTOALL.items()})
RUNS.update({name: (n, flags + SHARED, None) for name, (n, flags) in SHARED_EXPERTS.items()})
RUNS.update({name: (FAMILY_LAYOUTS[layout][0], family_args(family, FAMILY_LAYOUTS[layout][1]), "family")
             for name, (family, layout) in FAMILY_RUNS.items()})
RUNS.update({name: (n, flags + MTP_FLAGS, None) for name, (n, flags) in MTP.items()})
# MTP on packed documents (its shifts run over the whole sample, across documents, as megatron's at CP=1)
# and with multi-latent attention in its layer, each against CP=1 with the same flags.
MTP_WITH = {
    "cp4_ulysses2_ring2_mtp_docs": ("cp1_mtp_docs", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                                        "--hierarchical-context-parallel-sizes", "2", "2"]),
    "cp2_ring_mtp_mla": ("cp1_mtp_mla", 2, ["--context-parallel-size", "2"]),
    # PP: megatron builds the MTP layers on the last stage with a copy of the embedding (RoPE: no learned
    # position table to copy), and the last stage reads the tokens too.
    "pp2_cp2_mtp_rope": ("cp1_mtp_rope", 4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "pp2_dp2_mtp_rope_untied": ("cp1_mtp_rope_untied", 4, ["--pipeline-model-parallel-size", "2"]),  # DeepSeek-V3's untied head
}
# One MTP layer's weights for both depths (--mtp-use-repeated-layer, megatron-core 0.17 and later)
REPEATED = ["--mtp-use-repeated-layer"]
if MTP_REPEATED_LAYER:
    MTP_WITH["cp2_ring_mtp_repeated"] = ("cp1_mtp_repeated", 2, ["--context-parallel-size", "2"])
    RUNS["cp1_mtp_repeated"] = (1, MTP_FLAGS + REPEATED, None)
    RUNS["cp2_ring_mtp_repeated"] = (2, ["--context-parallel-size", "2"] + MTP_FLAGS + REPEATED, None)
MTP_ROPE = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]  # MODEL's RoPE
RUNS["cp1_mtp_docs"] = (1, MTP_FLAGS + DOC_FLAGS, "docs")
RUNS["cp4_ulysses2_ring2_mtp_docs"] = (4, MTP_WITH["cp4_ulysses2_ring2_mtp_docs"][2] + MTP_FLAGS + DOC_FLAGS, "docs")
RUNS["cp1_mtp_mla"] = (1, ["--mtp-num-layers", "2"] + MLA_FLAGS, None)
RUNS["cp2_ring_mtp_mla"] = (2, MTP_WITH["cp2_ring_mtp_mla"][2] + ["--mtp-num-layers", "2"] + MLA_FLAGS, None)
RUNS["cp1_mtp_rope"] = (1, MTP_ROPE, None)
RUNS["pp2_cp2_mtp_rope"] = (4, MTP_WITH["pp2_cp2_mtp_rope"][2] + MTP_ROPE, None)
RUNS["cp1_mtp_rope_untied"] = (1, MTP_ROPE + ["--untie-embeddings-and-output-weights"], None)
RUNS["pp2_dp2_mtp_rope_untied"] = (4, MTP_WITH["pp2_dp2_mtp_rope_untied"][2] + MTP_ROPE
                                   + ["--untie-embeddings-and-output-weights"], None)
MEGATRON_ROLL = "cp2_ring_contiguous_mtp_megatron_roll"  # megatron's own roll_tensor in cp_ext's place
RUNS[MEGATRON_ROLL] = (2, MTP["cp2_ring_contiguous_mtp"][1] + MTP_FLAGS, None)


@pytest.fixture(scope="module")
def runs(short_documents, quick):
    """``runs(name)``: (rank 0's metrics, full gradients) of layout ``name``; one launch per world size
    (under ``-m quick``: one per layout the quick test reads)."""
    done = {}

    def get(name):
        world = RUNS[name][0]
        if world not in done or name not in done[world]:
            names = [name] if quick else [n for n, (size, _, _) in RUNS.items() if size == world]
            results = launch(__file__, world, "--layouts", ",".join(names), "--docs", short_documents, timeout=900)
            done.setdefault(world, {}).update({n: _gather(results, n, world) for n in names})
        return done[world][name]

    return get


def _gather(results, name, nproc, flags=None):
    flags = RUNS[name][1] if flags is None else flags
    out_dir = Path(results[0]["results_dir"])
    if "--use-distributed-optimizer" in flags:
        # Its reduce-scatter leaves each DP rank only its own shard of the reduced gradient
        # (the rest of the buffer holds local partial sums), so gradients are compared through
        # the grad norm and the losses of the following iterations.
        return results[0][name], None
    full = {}
    for rank in range(nproc):
        for unit, (shape, index, values) in torch.load(out_dir / f"grads_{name}_rank{rank}.pt", weights_only=False).items():
            for idx, val in zip(index, values):
                full.setdefault(unit, torch.zeros(shape, dtype=torch.float64))[idx] = val.double()
    return results[0][name], full


@pytest.mark.quick
def test_cp2_ring_matches_single_process(runs):
    _assert_same(runs("cp2_ring"), runs("tp1pp1dp1"))


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k not in ("tp1pp1dp1", "cp2_ring") and k not in MASKED
                                    and k not in DOCUMENTS])
def test_layout_matches_single_process(layout, runs):
    _assert_same(runs(layout), runs("tp1pp1dp1"))


@pytest.mark.parametrize("layout", [k for k in DOCUMENTS if k != "cp1_docs"])
def test_packed_documents_match_single_process(layout, runs):
    _assert_same(runs(layout), runs("cp1_docs"))


@pytest.mark.parametrize("layout", [k for k in WINDOWS if k != "cp1_window"])
def test_window_and_sink_match_single_process(layout, runs):
    _assert_same(runs(layout), runs("cp1_window"))


@pytest.mark.parametrize("layout", [k for k in MLA if k != "cp1_mla"])
def test_multi_latent_attention_matches_single_process(layout, runs):
    """Losses, grad norms and every parameter gradient (MLA's projections and norms included) equal
    CP=1's; the latent is exchanged exactly where `auto` / --cp-mla-exchange say."""
    result = runs(layout)
    assert result[0]["latent exchange"] == [layout in LATENT], result[0]["latent exchange"]
    assert (result[0]["replayed"] > 0) == layout.endswith("_recompute"), result[0]["replayed"]
    assert any("linear_kv_up_proj" in u for u in result[1] or runs("cp1_mla")[1])
    assert any("kv_layernorm" in u for u in runs("cp1_mla")[1])  # --qk-layernorm: MLA's latent norms
    _assert_same(result, runs("cp1_mla"))


@pytest.mark.parametrize("layout", [k for k in QK_NORM if k != "cp1_qknorm"])
def test_qk_layernorm_matches_single_process(layout, runs):
    _assert_same(runs(layout), runs("cp1_qknorm"))
    norms = [u for u in runs("cp1_qknorm")[1] if "q_layernorm" in u or "k_layernorm" in u]
    assert len(norms) == 8 and all(runs("cp1_qknorm")[1][u].abs().max() > 0 for u in norms), norms


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.quick] if k == "dp4_ep2_alltoall" else [])
                                    for k in ALLTOALL])
def test_alltoall_dispatcher_matches_single_process_allgather(layout, runs):
    _assert_same(runs(layout), runs("tp1pp1dp1"))


@pytest.mark.parametrize("layout", [k for k in SHARED_EXPERTS if k != "cp1_shared"])
def test_shared_experts_overlapped_match_single_process(layout, runs):
    _assert_same(runs(layout), runs("cp1_shared"))
    assert any("shared_experts" in u for u in runs("cp1_shared")[1])


@pytest.mark.parametrize("run", [pytest.param(name, marks=[pytest.mark.quick] if name == "deepseek_r1_cp2_ring" else [])
                                 for name, (_, layout) in FAMILY_RUNS.items() if layout != "cp1"])
def test_family_matches_single_process(run, runs):
    family, _ = FAMILY_RUNS[run]
    _assert_same(runs(run), runs(f"{family}_cp1"))

@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.quick] if k == "cp2_ring_contiguous_mtp" else [])
                                    for k in MTP if k != "cp1_mtp"])
def test_multi_token_prediction_matches_single_process(layout, runs):
    """The lm loss, both depths' mtp losses, grad norms and every gradient (the MTP layers' included) equal CP=1's."""
    reference = runs("cp1_mtp")
    assert {"mtp_1 loss", "mtp_2 loss"} <= set(reference[0]), sorted(reference[0])
    mtp_units = [u for u in reference[1] if u.startswith("mtp.")]
    assert any("eh_proj" in u for u in mtp_units) and all(reference[1][u].abs().max() > 0 for u in mtp_units)
    _assert_same(runs(layout), reference)
    assert (runs(layout)[0]["replayed mtp"] > 0) == layout.endswith("_recompute"), runs(layout)[0]["replayed mtp"]
    evaluation, ref_evaluation = runs(layout)[0]["evaluation"], reference[0]["evaluation"]
    assert sorted(ref_evaluation) == ["lm loss", "mtp_1 loss", "mtp_2 loss"], ref_evaluation
    for key, value in ref_evaluation.items():
        assert abs(evaluation[key] - value) <= 1e-5 * value, f"evaluation's {key} {evaluation[key]} vs CP1's {value}"


@pytest.mark.parametrize("layout", list(MTP_WITH))
def test_multi_token_prediction_with_documents_and_mla_matches_single_process(layout, runs):
    reference = runs(MTP_WITH[layout][0])
    assert {"mtp_1 loss", "mtp_2 loss"} <= set(reference[0]), sorted(reference[0])
    _assert_same(runs(layout), reference)


@pytest.mark.skipif(not MTP_REPEATED_LAYER, reason="--mtp-use-repeated-layer needs megatron-core 0.17 or later "
                                                  "(tests/test_megatron_compat.py checks the refusal)")
def test_repeated_mtp_layer_shares_one_layer(runs):
    """--mtp-use-repeated-layer: both depths run MTP layer 0 (no layer 1), and the model trains otherwise."""
    (repeated, grads), (separate, separate_grads) = runs("cp1_mtp_repeated"), runs("cp1_mtp")
    layers = {u.split(".")[2] for u in grads if u.startswith("mtp.layers.")}
    assert layers == {"0"} and {u.split(".")[2] for u in separate_grads if u.startswith("mtp.layers.")} == {"0", "1"}
    assert abs(repeated["mtp_2 loss"][1] - separate["mtp_2 loss"][1]) > 1e-4 * separate["mtp_2 loss"][1]


def test_megatron_roll_is_off_on_contiguous_cp(runs):
    """The comparison above sees the shift: with megatron's own `roll_tensor` (its zigzag assumption) on
    the contiguous CP2 layout the mtp losses and the gradients move by far more than its tolerance,
    while iteration 1's lm loss (the main head, no shift) stays CP1's. (Measured: the mtp losses 3e-5 to
    1.4e-3 off, the grad norm 3e-3, the MTP layers' gradients up to 34%.)"""
    (run, grads), (ref, ref_grads) = runs(MEGATRON_ROLL), runs("cp1_mtp")
    assert abs(run["lm loss"][0] - ref["lm loss"][0]) <= 1e-5 * ref["lm loss"][0]
    off = max(abs(a - b) / b for key in ("mtp_1 loss", "mtp_2 loss") for a, b in zip(run[key], ref[key]))
    assert off > 10 * 1e-5, f"megatron's roll moves the mtp losses by only {off:.2e}"
    largest = max(g.abs().max().item() for g in ref_grads.values())
    moved = max((grads[u] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * largest) for u, g in ref_grads.items())
    assert moved > 100 * 1e-5, moved


def test_window_and_sink_change_training(runs):
    """The window and the sink are not dropped: the same model without them trains differently (by more
    than 100x the tolerance of the comparisons above), and the sink's parameter has a gradient."""
    (_, plain), (_, windowed) = runs("tp1pp1dp1"), runs("cp1_window")
    sinks = [u for u in windowed if "softmax_offset" in u]
    assert len(sinks) == 4 and all(windowed[u].abs().max() > 0 for u in sinks), sinks  # one per layer
    largest = max(g.abs().max().item() for g in windowed.values())
    moved = max((plain[u] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * largest)
                for u, g in windowed.items() if u in plain)
    assert moved > 100 * 1e-5, f"the window and sink moved no gradient by more than {moved:.2e} of its scale"


def test_packed_documents_change_training(runs):
    """Without the flags the same data trains differently: the comparisons above (1e-5 of each
    parameter's gradient scale) see the masks, by more than 100x their tolerance."""
    (_, unmasked), (_, masked) = runs(UNMASKED_DOCS), runs("cp1_docs")
    largest = max(g.abs().max().item() for g in masked.values())
    moved = max((unmasked[u] - g).abs().max().item() / max(g.abs().max().item(), 1e-3 * largest) for u, g in masked.items())
    assert moved > 100 * 1e-5, f"the document flags moved no gradient by more than {moved:.2e} of its scale"


def test_fully_masked_cp_shard(runs):
    result = runs("cp2_contiguous_masked")
    run = result[0]
    assert all(math.isfinite(x) for x in run["lm loss"] + run["grad norm"])
    _assert_same(result, runs("cp1_masked"))


def _assert_same(result, reference, tolerances=None, no_main_loss_grad=()):
    """``tolerances``: {substring of a unit: relative tolerance} for gradients looser than 1e-5 (each says why);
    ``no_main_loss_grad``: substrings of units the loss does not reach (DeepSeek-V4's indexer), left out of the
    check that every norm learns."""
    (run, grads), (ref, ref_grads) = result, reference
    for key in ("lm loss", "load balancing loss", "grad norm", *[k for k in ref if k.startswith("mtp_")],
                *[k for k in ref if k == "indexer loss"]):
        for it, (a, b) in enumerate(zip(run[key], ref[key])):
            assert abs(a - b) <= 1e-5 * abs(b), f"iteration {it + 1}: {key} {a} vs single-process {b}"
    if grads is None:
        return
    assert sorted(grads) == sorted(ref_grads), "the layouts disagree on which parameters exist"
    largest = max(g.abs().max().item() for g in ref_grads.values())
    for unit, ref in ref_grads.items():
        err = (grads[unit] - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-3 * largest)
        tol = next((t for part, t in (tolerances or {}).items() if part in unit), 1e-5)
        assert err <= tol * scale, f"{unit}: max |grad - ref| = {err:.3e}, max |ref| = {scale:.3e}"
    norm_units = [u for u in ref_grads if "norm" in u and not any(part in u for part in no_main_loss_grad)]
    assert norm_units and all(ref_grads[u].abs().max() > 0 for u in norm_units), "norm grads must be non-trivial"


class LinearLayerWatch:
    """Inside ``with``: every ``cls`` (a linear-attention mixer) built, and whether each of its forwards got document
    ids; `record(prefix)` after a run: {"<prefix> layers": their numbers, "<prefix> forwards with documents": [bool],
    "<prefix> replayed": recomputes served from kept gathers}; `reset` before the next run."""

    def __init__(self, cls):
        self.cls, self.modules, self.with_documents = cls, [], []

    def __enter__(self):
        self.real = self.cls.__init__, self.cls.forward
        watch, (real_init, real_forward) = self, self.real

        def init(module, *a, **kw):
            real_init(module, *a, **kw)
            watch.modules.append(module)

        def forward(module, hidden_states, attention_mask=None, **kw):
            watch.with_documents.append(attention_mask is not None)
            return real_forward(module, hidden_states, attention_mask, **kw)

        self.cls.__init__, self.cls.forward = init, forward
        return self

    def __exit__(self, *exc):
        self.cls.__init__, self.cls.forward = self.real

    def reset(self):
        self.modules.clear(), self.with_documents.clear()

    def record(self, prefix):
        return {f"{prefix} layers": sorted({m.layer_number for m in self.modules}),
                f"{prefix} forwards with documents": sorted(set(self.with_documents)),
                f"{prefix} replayed": sum(m.kept_exchanges.replayed for m in self.modules)}


def launch_layouts(script, world, names, timeout=1200, extra=()):
    """Run ``names`` in one launch of ``world`` ranks of ``script``'s worker (``--layouts``, then ``extra``; each rank
    saves its gradient slices as grads_<name>_rank<r>.pt): {name: (rank 0's metrics, every full gradient, float64)}."""
    results = launch(script, world, "--layouts", ",".join(names), *extra, timeout=timeout)
    out_dir = Path(results[0]["results_dir"])
    done = {}
    for n in names:
        full = {}
        for rank in range(world):
            for unit, (shape, index, values) in torch.load(out_dir / f"grads_{n}_rank{rank}.pt",
                                                           weights_only=False).items():
                for idx, val in zip(index, values):
                    full.setdefault(unit, torch.zeros(shape, dtype=torch.float64))[idx] = val.double()
        done[n] = (results[0][n], full)
    return done


def _grad_slices(model):
    """{unit: (full shape, [index...], [local grad...])} of this rank, after the last backward."""
    from cp_ext.models.parameter_slices import iter_global_slices, parameters_showing_grads

    out = {}
    with parameters_showing_grads(model):
        for piece in iter_global_slices(model):
            entry = out.setdefault(piece.unit, (piece.unit_shape, [], []))
            entry[1].append(piece.index)
            entry[2].append(piece.local.detach().clone())
    return out


@contextlib.contextmanager
def _megatron_roll(on):
    """`cp_ext.models.mtp`'s shifts replaced by megatron-core's `roll_tensor` (for `MEGATRON_ROLL`)."""
    import cp_ext.models.mtp as mtp
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    def roll(tensor, layout=None, dim=-1, dynamic=None, fill=0):  # static CP only: dynamic is None here
        return roll_tensor(tensor, shifts=-1, dims=dim, cp_group=mpu.get_context_parallel_group())[0]

    class Sequence:
        def __init__(self, local, layout=None, dim=-1, dynamic=None):
            self.local, self.dim = local, dim

        def shifted(self, k, fill=0):
            out = self.local
            for _ in range(k):
                out = roll(out, dim=self.dim)
            return out

    saved = mtp.roll_left, mtp.GlobalSequence
    if on:
        mtp.roll_left, mtp.GlobalSequence = roll, Sequence
    try:
        yield
    finally:
        mtp.roll_left, mtp.GlobalSequence = saved


def _train(name, args):
    """Two iterations of layout ``name`` (three with the distributed optimizer) on this launch's
    ranks: (metrics, iteration 1's grads)."""
    import cp_ext.training.trainer as trainer_module
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    mask_second_half = MASK_SECOND_HALF in args
    trainer = Trainer(parse_args([a for a in args if a != MASK_SECOND_HALF]))
    real_microbatches = trainer_module.microbatches
    if mask_second_half:
        seq = trainer.args.seq_length

        def masked(*a, **kw):
            for mb in real_microbatches(*a, **kw):
                mb.loss_mask[mb.position_ids >= seq // 2] = 0.0
                yield mb

        trainer_module.microbatches = masked
    try:
        history, grads = {"lm loss": [], "load balancing loss": [], "grad norm": []}, None
        for _ in range(3 if "--use-distributed-optimizer" in args else 2):
            with _megatron_roll(name == MEGATRON_ROLL):
                metrics = trainer.train_step()
            for key in [k for k in metrics if k.startswith("mtp_") or k == "indexer loss"]:  # mtp_1 loss, ...; DSA's
                history.setdefault(key, [])
            for key in history:  # no load-balancing loss where its coefficient is 0 (GPT-OSS)
                history[key].append(metrics.get(key, 0.0))
            if grads is None:
                grads = _grad_slices(trainer.model[0].module)
    finally:
        trainer_module.microbatches = real_microbatches
    from cp_ext.transformer.attention import CoreAttention
    from cp_ext.transformer.mla import ContextParallelMLASelfAttention

    if "--mtp-num-layers" in args:  # evaluation's losses too, on the first global batch of the train split
        from cp_ext.training.evaluation import evaluate_losses

        history["evaluation"] = evaluate_losses(trainer, trainer.dataset, 1)
    mla = [m for m in trainer.model[0].module.modules() if isinstance(m, ContextParallelMLASelfAttention)]
    history["latent exchange"] = sorted({m.latent_exchange() for m in mla})
    history["up proj recompute"] = sorted({m.recompute_up_proj for m in mla})  # --recompute-modules mla_up_proj
    history["replayed"] = sum(m.kept.replayed for m in trainer.model[0].module.modules() if isinstance(m, CoreAttention))
    mtp = getattr(trainer.model[0].module, "mtp", None)
    history["replayed mtp"] = 0 if mtp is None else sum(m.kept.replayed for m in mtp.modules() if isinstance(m, CoreAttention))
    trainer.shutdown(keep_process_group=True)
    return history, grads


def worker():
    import os
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:], required=["--layouts", "--docs"])
    results = {"results_dir": opts.results_dir}
    for name in opts.layouts.split(","):
        _, flags, data = RUNS[name]
        args = flags if data == "family" else MODEL + flags + (["--data-path", opts.docs] if data == "docs" else [])
        results[name], grads = _train(name, args)
        torch.save(grads, Path(opts.results_dir, f"grads_{name}_rank{os.environ['RANK']}.pt"))
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
