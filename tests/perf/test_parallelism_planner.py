"""tools/plan_parallelism.py and cp_ext.perf: exact against hand arithmetic (pure Python, fast)."""

from pathlib import Path

import pytest

from cp_ext.cli import plan_parallelism as plan_cli
from cp_ext.perf import comm
from cp_ext.perf import parallelism_planner as planner
from cp_ext.perf.memory import (
    GiB, PRESETS, Grid, ModelShape, activation_bytes, all_gather_transient_bytes, bytes_per_param, kv_state_bytes,
    params_per_layer, rank_memory, total_params, weight_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.quick
def test_kv_arithmetic_7b_and_70b_at_128k():
    # 7B: 32 layers x 4096 hidden x 2 (K, V) x 2 bytes x 131072 tokens = 64 GiB
    assert kv_state_bytes(PRESETS["llama2-7b"], s=131072, dtype="bf16")["kv"] == 32 * 4096 * 2 * 2 * 131072 == 64 * GiB
    # 70B taken as MHA: 80 layers x 8192 hidden -> 320 GiB; with its 8 KV heads: 40 GiB
    m70 = PRESETS["llama2-70b"]
    assert kv_state_bytes(m70, s=131072, mha=True)["kv"] == 80 * 8192 * 2 * 2 * 131072 == 320 * GiB
    assert kv_state_bytes(m70, s=131072)["kv"] == 40 * GiB
    # split over TP x CP
    assert kv_state_bytes(PRESETS["llama2-7b"], s=131072, tp=2, cp=8)["kv"] == 4 * GiB


def test_kv_arithmetic_cli(capsys):
    assert plan_cli.main(["--model", "llama2-70b", "--kv-arithmetic"]) == 0
    out = capsys.readouterr().out
    assert "= 320.0 GiB" in out and "= 40.0 GiB" in out


def test_param_counts_match_llama2_7b():
    m = PRESETS["llama2-7b"]
    per = params_per_layer(m)
    assert per["dense"] == 4 * 4096 * 4096 + 2 * 4096 + 3 * 4096 * 11008
    assert total_params(m) == 32 * per["dense"] + 2 * 32000 * 4096 + 4096 == 6_738_415_616  # the published 6.74B


def test_bytes_per_param():
    assert sum(bytes_per_param("bf16", False, 8).values()) == 18
    assert sum(bytes_per_param("bf16", True, 8).values()) == 2 + 4 + 12 / 8
    assert sum(bytes_per_param("fp32", False, 1).values()) == 16


def test_weight_bytes_by_hand():
    m = ModelShape(layers=4, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=256, experts=4, topk=2)
    g = Grid(tp=2, pp=2, cp=2, dp=2, ep=2, etp=2)
    w = weight_bytes(m, g, distributed_optimizer=True)
    # 2 layers/stage, /TP; embedding /TP (first stage) or output layer /TP + final norm (last: the heavier)
    dense = (2 * (4 * 64 * 64 + 2 * 64 + 64 * 4) + 256 * 64 + 64) / 2
    expert = 2 * 4 * 3 * 64 * 128 / (2 * 2)
    assert w["params"] == dense + expert
    assert w["weights"] == 2 * (dense + expert) and w["grads"] == 4 * (dense + expert)
    assert w["optimizer"] == dense * 12 / 4 + expert * 12 / 2  # D = DP x CP = 4; expert DP = 8 / (EP x ETP) = 2


def test_activation_formula_by_hand_and_scaling():
    m = ModelShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=384)
    a1 = activation_bytes(m, s=4096, dtype="fp32")
    # per layer per token (cp_ext.perf.activations): norms 2 x 3h, mixed QKV 3h, RoPE'd q and k 2h,
    # RoPE 4d, attention output h, MLP 5f elements (fp32) + 2 rstd + 4 LSE
    per_layer = (6 * 64 + 3 * 64 + 2 * 64 + 4 * 16 + 64 + 5 * 128) * 4 + (2 + 4) * 4
    assert a1["layers"] == 2 * 4096 * per_layer
    # final norm 3h + rstd, fp32 logits, ids + labels (int64), loss mask (bool), per-token loss
    assert a1["embedding+logits"] == 4096 * (3 * 64 * 4 + 4 + 384 * 4 + 8 + 8 + 1 + 4)
    a2 = activation_bytes(m, s=4096, cp=2, dtype="fp32")
    assert a2["total"] / a1["total"] <= 1.15 / 2
    # full recompute keeps only the layer inputs, plus the larger of one layer's working set
    # (its input is the checkpoint itself) and the logits' activations
    plain = activation_bytes(m, s=4096, dtype="fp32", recompute="full")
    inputs = 2 * 4096 * 64 * 4
    assert plain["total"] == inputs + max(4096 * per_layer - 4096 * 64 * 4, a1["embedding+logits"])
    # CP-aware full recompute also keeps each layer's attention output (h) and LSE (a, fp32); the
    # layer being recomputed uses its kept ones (they are part of its working set)
    aware = activation_bytes(m, s=4096, dtype="fp32", recompute="full_cp_aware")
    kept = 4096 * (64 * 4 + 4 * 4)
    assert aware["total"] - plain["total"] == 2 * kept - kept
    assert activation_bytes(m, s=4096, dtype="fp32", recompute=True) == aware
    with pytest.raises(ValueError):
        activation_bytes(m, s=4096, recompute="selective")


def test_comm_formulas_by_hand():
    # ring: fwd KV, bwd KV + R dKV (fp32)
    kv = 2 * 1 * 8 * 2048 * 64 * 4
    assert comm.ring_bytes(b=1, hk=8, s_local=2048, d=64, ring=2, dtype="fp32") == {"fwd": kv, "bwd": kv + 2 * kv}
    bf = comm.ring_bytes(b=1, hk=8, s_local=2048, d=64, ring=4, dtype="bf16")
    assert bf == {"fwd": 3 * kv // 2, "bwd": 3 * kv // 2 + 4 * kv}
    # Ulysses: 4 exchanges fwd of (U-1)/U of q, k, v, out
    q = 1 * 8 * 2048 * 64 * 4
    assert comm.ulysses_bytes(b=1, h=8, hk=8, s_local=2048, d=64, ulysses=2, dtype="fp32") == {"fwd": 2 * q, "bwd": 2 * q}
    # GQA hk=2 < U=4: KV heads replicated x2 to 4 -> k, v at half of q's heads
    u = comm.ulysses_bytes(b=1, h=8, hk=2, s_local=2048, d=64, ulysses=4, dtype="fp32")
    assert u["fwd"] == 3 * (2 * q // 4 + 2 * (q // 2) // 4)
    # hybrid C = 4 = U2 x R2: ring over s/2 tokens with h/U, hk/U heads
    hy = comm.cp_attention_bytes(b=1, h=8, hk=8, s=8192, d=64, cp=4, ulysses=2, dtype="fp32")
    assert hy["ring_p2p"] == comm.ring_bytes(b=1, hk=4, s_local=4096, d=64, ring=2, dtype="fp32")
    assert hy["ulysses_a2a"] == comm.ulysses_bytes(b=1, h=8, hk=8, s_local=2048, d=64, ulysses=2, dtype="fp32")
    # TP with SP: 4 x (t-1)/t x sbh each way; EP: dispatch + combine each way
    assert comm.tp_layer_bytes(b=1, s=4096, hidden=1024, tp=4, dtype="bf16")["fwd"] == 4 * 4096 * 1024 * 2 * 3 // 4
    assert comm.ep_layer_bytes(b=1, s=4096, hidden=1024, topk=2, ep=4, tp=2, dtype="bf16")["bwd"] == 2 * (2048 * 2 * 1024 * 2 * 3 // 4)


def test_all_gather_transient_by_hand():
    m = ModelShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=384)
    # [2, b, hk/TP, s, d] gathered K/V in the activation dtype; backward adds the fp32 dK/dV, and the
    # call's fp32 results: this rank's 1/cp of dK/dV and dQ [b, h/TP, s/cp, d]
    kv, q = 2 * 4 * 4096 * 16, 4 * 4096 / 8 * 16
    bwd = kv * 4 + kv * 4 * (1 + 1 / 8) + q * 4
    assert all_gather_transient_bytes(m, s=4096, cp=8, dtype="fp32") == {"fwd": kv * 4, "bwd": bwd, "peak": bwd}
    assert all_gather_transient_bytes(m, s=4096, cp=8, dtype="bf16")["peak"] == kv * 2 + kv * 4 * (1 + 1 / 8) + q * 4
    assert all_gather_transient_bytes(m, s=4096, tp=2, cp=8, dtype="bf16")["peak"] == (
        (kv * 2 + kv * 4 * (1 + 1 / 8) + q * 4) / 2)  # heads / TP
    assert all_gather_transient_bytes(m, s=4096, cp=1)["peak"] == 0
    # today's behaviour by default, and every Megatron name but all_gather leaves it alone
    base = activation_bytes(m, s=4096, cp=8, dtype="fp32")
    for name in (None, "p2p", "a2a", "a2a+p2p"):
        assert activation_bytes(m, s=4096, cp=8, dtype="fp32", cp_comm_type=name) == {**base, "attention_transient": 0.0}
    with pytest.raises(ValueError):
        activation_bytes(m, s=4096, cp=8, cp_comm_type="allgather")
    # CP8, 512 tokens per rank: the transient exceeds what is freed before the last layer's attention
    # backward (logits + that layer's post-attention part: linear_proj input h, norm 3h + rstd, MLP 5f),
    # so it sets the peak: saved layers - post-attention + transient
    ag = activation_bytes(m, s=4096, cp=8, dtype="fp32", cp_comm_type="all_gather")
    per_layer = (6 * 64 + 3 * 64 + 2 * 64 + 4 * 16 + 2 * 64 + 5 * 128) * 4 + (2 + 4) * 4  # + h: CP keeps its output apart
    layers = 2 * 512 * per_layer
    post = 512 * ((3 * 64 + 64 + 5 * 128) * 4 + 4)
    assert base["total"] == layers + 512 * (3 * 64 * 4 + 4 + 384 * 4 + 21)
    assert ag["attention_transient"] == bwd and ag["total"] == layers - post + bwd > base["total"]
    # CP2: the same transient hides under the logits and the post-attention activations: no change
    assert activation_bytes(m, s=4096, cp=2, dtype="fp32", cp_comm_type="all_gather")["total"] == \
        activation_bytes(m, s=4096, cp=2, dtype="fp32")["total"]
    # full recompute: on top of the recomputed layer's pre-attention part
    for mode in ("full", "full_cp_aware"):
        plain = activation_bytes(m, s=4096, cp=8, dtype="fp32", recompute=mode)
        agr = activation_bytes(m, s=4096, cp=8, dtype="fp32", recompute=mode, cp_comm_type="all_gather")
        # plain["layers"] = the held checkpoints + the recomputed layer's activations
        assert agr["total"] == max(plain["total"], plain["layers"] - post + bwd) > plain["total"]


def test_all_gather_comm_formula_by_hand():
    kv = 2 * 1 * 2 * 64 * 16 * 4  # [2, b, hk, s_local, d] fp32
    ag = comm.cp_attention_bytes(b=1, h=4, hk=2, s=256, d=16, cp=4, ulysses=1, dtype="fp32", comm_type="all_gather")
    assert ag["all_gather_kv"] == {"fwd": 3 * kv, "bwd": 3 * kv}  # forward and backward gather
    assert ag["reduce_scatter_dkv"] == {"fwd": 0, "bwd": 3 * kv}  # fp32 accumulator, C-1 blocks leave
    assert ag["ring_p2p"] == ag["ulysses_a2a"] == {"fwd": 0, "bwd": 0}
    bf = comm.all_gather_bytes(b=1, hk=2, s_local=64, d=16, cp=4, dtype="bf16")
    assert bf["all_gather_kv"]["fwd"] == 3 * kv // 2 and bf["reduce_scatter_dkv"]["bwd"] == 3 * kv
    ring = comm.cp_attention_bytes(b=1, h=4, hk=2, s=256, d=16, cp=4, ulysses=1, dtype="fp32")
    assert ring["all_gather_kv"] == ring["reduce_scatter_dkv"] == {"fwd": 0, "bwd": 0} and ring["ring_p2p"]["fwd"] == 3 * kv


def test_planner_ranks_all_gather_layouts_when_asked(capsys):
    m = ModelShape(layers=6, hidden=1024, heads=12, kv_heads=4, ffn=4096, vocab=32000)
    kw = dict(s=12288, global_batch=6, gpu_memory=24 * GiB, gpus_per_node=4, nodes=2)
    default = planner.plan(m, **kw)
    both = planner.plan(m, **kw, cp_comm_types=(None, "all_gather"))
    ag = [p for p in both if p.comm_type == "all_gather"]
    # one more plan per valid CP > 1 layout, none at CP = 1; the default plans are unchanged
    assert len(both) == len(default) + sum(1 for p in default if p.grid.cp > 1 and p.memory)
    assert ag and all(p.grid.cp > 1 and p.grid.ulysses == 1 for p in ag)
    assert [p for p in both if p.comm_type is None] == default
    for p in ag:
        g = p.grid
        assert p.memory == rank_memory(m, g, s=12288, recompute=p.recompute, microbatches=6 // g.dp,
                                       cp_comm_type="all_gather")
        cpb = comm.cp_attention_bytes(b=1, h=12 // g.tp, hk=max(1, 4 // g.tp), s=12288, d=1024 // 12, cp=g.cp,
                                      ulysses=1, dtype="bf16", comm_type="all_gather")
        assert p.comm_per_layer["cp_all_gather"] == sum(cpb["all_gather_kv"].values()) + cpb["reduce_scatter_dkv"]["bwd"]
        assert p.comm_per_layer["cp_ring"] == p.comm_per_layer["cp_ulysses"] == 0
    assert plan_cli.main(["--layers", "6", "--hidden", "1024", "--heads", "12", "--kv-heads", "4", "--ffn", "4096",
                          "--vocab", "32000", "--seq-length", "12288", "--global-batch", "6", "--gpu-memory-gib", "24",
                          "--gpus-per-node", "4", "--nodes", "2", "--cp-comm-types", "a2a+p2p", "all_gather",
                          "--top", "50"]) == 0
    out = capsys.readouterr().out
    assert "(AG)" in out and "all-gather transient" in out and "(U1xR" in out


def test_small_model_layouts_ranked_and_invalid_excluded_with_reason():
    m = ModelShape(layers=6, hidden=1024, heads=12, kv_heads=4, ffn=4096, vocab=32000)
    plans = planner.plan(m, s=12288, global_batch=6, gpu_memory=24 * GiB, gpus_per_node=4, nodes=2)
    assert len(plans) == sum(1 for tp in range(1, 9) if 8 % tp == 0 for pp in planner.divisors(8 // tp)
                             for cp in planner.divisors(8 // (tp * pp)))
    valid = [p for p in plans if p.valid]
    invalid = {(p.grid.tp, p.grid.pp, p.grid.cp): p.reason for p in plans if not p.valid}
    assert valid and all(p.memory["total"] <= 0.9 * 24 * GiB for p in valid)
    assert "TP 8 does not divide the 12 heads" in invalid[(8, 1, 1)]
    assert "PP 4 does not divide the 6 layers" in invalid[(1, 4, 1)]
    assert "global batch 6 is not divisible by DP 4" in invalid[(1, 1, 2)]
    # no-recompute layouts come before those needing recompute; then by estimated comm time
    flags = [p.recompute is not None for p in valid]
    assert flags == sorted(flags) and set(p.recompute for p in valid) <= {None, "full_cp_aware"}
    for p in valid:
        g = p.grid
        assert g.tp * g.pp * g.cp * g.dp == 8 and g.cp % g.ulysses == 0 and (12 // g.tp) % g.ulysses == 0
        expect = rank_memory(m, g, s=12288, recompute=p.recompute, microbatches=6 // g.dp)
        assert p.memory == expect


def test_cli_runs(capsys):
    assert plan_cli.main(["--model", "mixtral-8x7b", "--seq-length", "32768", "--global-batch", "32", "--nodes", "2",
                          "--top", "3", "--show-invalid"]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "excluded" in out and "EP" in out


@pytest.mark.quick
@pytest.mark.parametrize("flags", [["--layers", "2"], []])
def test_cli_needs_a_model(flags):
    with pytest.raises(SystemExit):
        plan_cli.main(flags)


# The 128K family configs: (nodes of 8 x 80 GiB GPUs, total parameters in billions, planned GiB per rank).
FAMILY_CONFIGS = {"deepseek_v3_128k_32x8gpu.yaml": (32, 671.0, 69.1), "qwen3_30b_a3b_128k_8x8gpu.yaml": (8, 30.5, 52.7),
                  "gpt_oss_120b_128k_8x8gpu.yaml": (8, 116.8, 63.1)}


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_family_configs_carry_the_planners_first_layout(name, monkeypatch):
    """The config's grid and recompute are the planner's first layout for the model the config
    describes (`ModelShape.from_args`), at the estimate its header states."""
    from cp_ext.arguments import parse_args
    from cp_ext.perf.model_shape import ModelShape

    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)  # a GPU config on this host
    nodes, billions, gib = FAMILY_CONFIGS[name]
    args = parse_args(["--config", str(ROOT / "configs" / name)], world_size=8 * nodes)
    m = ModelShape.from_args(args)
    assert round(total_params(m) / 1e9, 1) == billions
    best = planner.plan(m, s=args.seq_length, global_batch=args.global_batch_size, gpu_memory=80 * GiB,
                        gpus_per_node=8, nodes=nodes)[0]
    g = best.grid
    assert best.valid and (g.tp, g.pp, g.cp, g.ep, g.etp, g.ulysses) == (
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
        args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.ulysses_size), (name, g)
    assert (best.recompute is not None) == (args.recompute_granularity == "full"), name
    assert round(best.memory["total"] / GiB, 1) == gib, (name, best.memory["total"] / GiB)
    assert f"= {gib} GiB" in (ROOT / "configs" / name).read_text()


def test_mla_layer_comm_per_head_or_latent():
    """MLA's CP bytes: the latent (r + p per token) where cp_ext's MLA takes it (TP1, ring), else
    per-head K of d_qk + p and V of d_v; dense-first layers send no EP bytes."""
    m = ModelShape(layers=4, hidden=256, heads=8, kv_heads=8, ffn=512, vocab=384, experts=4, topk=2, moe_ffn=64,
                   moe_layer_freq=(0, 1, 1, 1), multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=32,
                   qk_pos_emb_head_dim=16, v_head_dim=32)
    ring = planner.layer_comm(m, Grid(cp=4, dp=1, ep=4), s=4096, b=1, dtype="bf16")
    latent = comm.mla_exchange_bytes(b=1, h=8, s_local=1024, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32,
                                     kv_lora_rank=32, cp=4, dtype="bf16", exchange="latent")
    assert ring["mla_latent"] and ring["cp_ring"] == latent["ring_p2p"]["fwd"] + latent["ring_p2p"]["bwd"]
    # TP2: per-head K/V, 8/2 heads x (48 + 32) values per token, as the GQA formula's 2 d at d = 40
    tp2 = planner.layer_comm(m, Grid(tp=2, cp=4, ep=4, etp=2), s=4096, b=1, dtype="bf16")
    kv = comm.ring_bytes(b=1, hk=4, s_local=1024, d=40, ring=4, dtype="bf16")
    assert not tp2["mla_latent"] and tp2["cp_ring"] == kv["fwd"] + kv["bwd"]
    assert ring["ep"] == 0.75 * sum(comm.ep_layer_bytes(b=1, s=4096, hidden=256, topk=2, ep=4, cp=4).values())
    # the attention state: per-head K (48) and V (32) per token and layer, or the latent's r + p = 48
    assert kv_state_bytes(m, s=4096, cp=4)["kv"] == 4 * 8 * (48 + 32) * 4096 * 2 / 4
    assert kv_state_bytes(m, s=4096, cp=4, latent=True)["kv"] == 4 * 48 * 4096 * 2 / 4


def test_grid_from_args_is_the_grid_a_checkpoint_records():
    """One grid description: parsed flags -> the planner's Grid; the checkpoint metadata records the same sizes."""
    from cp_ext.arguments import parse_args
    from cp_ext.perf.memory import GRID_FLAGS, Grid
    from cp_ext.checkpoint.disk_format import GRID_FLAGS as CHECKPOINT_GRID

    args = parse_args(["--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "4",
                       "--ulysses-size", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                       "--seq-length", "64"], world_size=32)
    assert Grid.from_args(args) == Grid(tp=2, pp=2, cp=4, dp=2, ep=4, etp=1, ulysses=2)
    assert Grid.from_args(args).world == 32
    assert set(GRID_FLAGS.values()) <= set(CHECKPOINT_GRID)
    # what meta.json records: every size by its flag, as the flags gave them
    meta = Grid.from_args(args).as_meta()
    assert meta == {name: getattr(args, name) for name in CHECKPOINT_GRID if name != "use_distributed_optimizer"}


# A Qwen3-Next-shaped hybrid: three Gated DeltaNet layers to one softmax layer.
HYBRID = ModelShape(layers=8, hidden=2048, heads=16, kv_heads=2, ffn=5120, vocab=151936, kv_channels=256,
                    linear_attention_freq=4, linear_key_heads=16, linear_value_heads=32)


@pytest.mark.quick
def test_linear_layers_exchange_states_not_kv():
    """Per layer, the linear layers' CP bytes are their halo and state exchange (`comm.gated_delta_layer_bytes`),
    weighted by their share of the layers; the softmax layers' K/V traffic by theirs; KV only on softmax layers."""
    g = Grid(tp=2, pp=1, cp=4, dp=1)
    per = planner.layer_comm(HYBRID, g, s=32768, b=1, dtype="bf16")
    expected = comm.gated_delta_layer_bytes(method="state_passing", b=1, s=32768, hk=8, h=16, k_dim=128, v_dim=128,
                                            cp=4, dtype="bf16", kernel_size=4)
    one = sum(x["fwd"] + x["bwd"] for x in expected.values())
    assert one > 0 and per["cp_linear"] == pytest.approx(one * 6 / 8)
    plain = planner.layer_comm(ModelShape(**{**HYBRID.__dict__, "linear_attention_freq": None}), g, s=32768, b=1,
                               dtype="bf16")
    assert per["cp_ring"] == pytest.approx(plain["cp_ring"] * 2 / 8) and plain.get("cp_linear", 0) == 0
    assert kv_state_bytes(HYBRID, s=1024)["kv"] == kv_state_bytes(plain_model := ModelShape(
        **{**HYBRID.__dict__, "linear_attention_freq": None}), s=1024)["kv"] * 2 / 8
    assert plain_model.linear_attention_freq is None


@pytest.mark.quick
def test_planner_runs_hybrids_on_the_ring_and_checks_the_linear_heads():
    plans = planner.plan(HYBRID, s=32768, global_batch=8, gpu_memory=80 * GiB, gpus_per_node=8, nodes=4)
    assert all(p.grid.ulysses == 1 for p in plans if p.valid)  # state passing runs on the ring
    bad = [p for p in plans if p.grid.tp == 32]
    assert bad and all(not p.valid for p in bad)
    odd = ModelShape(**{**HYBRID.__dict__, "kv_heads": 4, "linear_key_heads": 6, "linear_value_heads": 12})
    reasons = [p.reason for p in planner.plan(odd, s=32768, global_batch=8, gpu_memory=80 * GiB, gpus_per_node=8,
                                              nodes=1) if p.grid.tp == 4]
    assert reasons and all("linear layers' 6 key / 12 value heads" in r for r in reasons)


def test_linear_arithmetic_names_state_halo_and_methods():
    text = planner.linear_arithmetic(HYBRID, 131072, cp=32)
    assert "linear layers: 6 of 8" in text and "32 heads x 128 x 128 x 4 B = 2.0 MiB" in text
    assert "state passing (all_gather)" in text and "state passing (ring)" in text
    assert "all-to-all: cannot split 16 key heads / TP1 over CP32" in text  # state passing has no such limit
    assert "all-to-all " in planner.linear_arithmetic(HYBRID, 131072, cp=8)  # 16 heads split 8 ways
    assert "6 softmax layers" not in planner.kv_arithmetic(HYBRID, 1024) and "2 softmax layers" in \
        planner.kv_arithmetic(HYBRID, 1024)
