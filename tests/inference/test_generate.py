"""Generation with a CP-sharded KV cache equals CP=1 generation, which equals a full forward.

One 4-rank launch builds the same small GQA MoE model (fp32, random weights from --seed) at
CP1 (DP4), CP2 ring, CP2 Ulysses and CP4 = Ulysses 2 x ring 2 (and an MQA model, one KV head for
Ulysses 2: replicated in the cache, at CP1 and CP4; CP2 with EP2; PP2 x CP2; TP2+SP x CP2; TP2+SP x PP2), and generates 6 greedy tokens
after prompts of 1030 tokens (not a multiple of 2C: the tail is decoded token by token) and
8192 tokens; a model with GPT-OSS's attention (a window of 96 on layer 1 of 2, a learnable
sink) at CP1, CP2 ring and CP4 hybrid; one with DeepSeek-V3's (MLA with q-LoRA and YaRN) at CP1,
CP2 ring (which caches the latent) and CP4 hybrid; and that MLA made DeepSeek-V3.2's sparse attention
(top 64 keys; the cache keeps [latent | indexer key], each step's top-k merged from every rank's
candidates) at CP1, CP2 ring, CP2 all-gather and TP2+SP x CP2; and a Qwen3-Next hybrid (Gated DeltaNet on layer 1:
its state and conv tail are its cache) at CP1, CP2 ring, CP4 ring, TP2+SP x CP2 and PP2 x CP2, and Kimi Delta
Attention's at CP1, CP2 ring and TP2+SP x CP2. Checked:
  * the token ids of every layout equal CP1's, and every step's logits within 1e-5 relative;
  * CP1's decode logits equal one full forward over prompt + generated tokens (the cache path
    itself is right, not only consistent);
  * each rank holds 1/C of CP1's KV-cache bytes (up to the round-robin tail).
"""

import sys

import pytest

from tests.launch import launch, selected, worker_args, write_results

MODEL = ["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--num-experts", "4", "--moe-ffn-hidden-size", "64", "--seq-length", "64",
         "--seed", "7", "--train-iters", "1"]
WINDOW = ["--window-size", "96,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable"]
MLA = ["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "4", "--q-lora-rank", "24", "--kv-lora-rank", "32",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "4"]
MLA_LATENT_RATIO = (32 + 8) / (4 * (16 + 8 + 16))  # cached values per token: latent vs 4 heads' K/V
# DeepSeek-V3.2's sparse attention on that MLA: each token attends to its top 64 (of up to 8198) keys
DSA = MLA + ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "16",
             "--dsa-indexer-topk", "64"]
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2", "--linear-num-key-heads", "2",
       "--linear-num-value-heads", "4", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16",
       "--attention-output-gate"]
KDA = ["--experimental-attention-variant", "kda", "--linear-attention-freq", "2", "--linear-num-key-heads", "2",
       "--linear-num-value-heads", "2", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16"]
LAYOUTS = {
    "cp1": [],
    "cp2_ring": ["--context-parallel-size", "2"],
    "cp2_ulysses": ["--context-parallel-size", "2", "--ulysses-size", "2"],
    "cp4_hybrid": ["--context-parallel-size", "4", "--ulysses-size", "2"],
    "cp2_ring_ep2": ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"],  # experts over DP x CP
    "pp2_cp2": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],  # one layer per stage
    "tp2sp_cp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    "tp2sp_pp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"],
    # one KV head for 4 query heads: fewer KV heads than Ulysses ranks, replicated in the cache
    "mqa_cp1": ["--group-query-attention", "--num-query-groups", "1"],
    "mqa_cp4_hybrid": ["--group-query-attention", "--num-query-groups", "1", "--context-parallel-size", "4", "--ulysses-size", "2"],
    # GPT-OSS's attention: a sliding window on every other layer (layer 1 of 2) and a learnable sink
    "win_cp1": WINDOW,
    "win_cp2_ring": WINDOW + ["--context-parallel-size", "2"],
    "win_cp4_hybrid": WINDOW + ["--context-parallel-size", "4", "--ulysses-size", "2"],
    # DeepSeek-V3's attention (q-LoRA, YaRN): the ring caches the latent, the hybrid per-head K/V
    "mla_cp1": MLA,
    "mla_cp2_ring": MLA + ["--context-parallel-size", "2"],
    "mla_cp4_hybrid": MLA + ["--context-parallel-size", "4", "--ulysses-size", "2"],
    # DeepSeek-V3's MTP layers are trained, not decoded: generation uses the main head, so the same seed
    # generates what the model without them does (layout-invariant init: the same main weights)
    "mtp_cp2_ring": ["--mtp-num-layers", "1", "--context-parallel-size", "2"],
    "mtp_pp2_cp2": ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
    # DSA: the cache keeps [latent | indexer key]; each decode step's top-k merged from every rank's candidates
    "dsa_cp1": DSA,
    "dsa_cp2_ring": DSA + ["--context-parallel-size", "2"],
    "dsa_cp2_all_gather": DSA + ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
    "dsa_tp2sp_cp2": DSA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    # Qwen3-Next's Gated DeltaNet on layer 1 of 2: its cache is the state after the prompt (folded under CP) and
    # the conv's last inputs; decode continues from them on every rank with no exchange
    "gdn_cp1": GDN,
    "gdn_cp2_ring": GDN + ["--context-parallel-size", "2"],
    "gdn_cp4_ring": GDN + ["--context-parallel-size", "4"],
    "gdn_tp2sp_cp2": GDN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    "gdn_pp2_cp2": GDN + ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
    # Kimi Delta Attention on layer 1: the same cache, its per-channel decay
    "kda_cp1": KDA,
    "kda_cp2_ring": KDA + ["--context-parallel-size", "2"],
    "kda_tp2sp_cp2": KDA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
}
REFERENCE = {"cp2_ring": "cp1", "cp2_ulysses": "cp1", "cp4_hybrid": "cp1", "cp2_ring_ep2": "cp1",
             "pp2_cp2": "cp1", "tp2sp_cp2": "cp1", "tp2sp_pp2": "cp1", "mqa_cp4_hybrid": "mqa_cp1",
             "win_cp2_ring": "win_cp1", "win_cp4_hybrid": "win_cp1", "mla_cp2_ring": "mla_cp1",
             "mla_cp4_hybrid": "mla_cp1", "mtp_cp2_ring": "cp1", "mtp_pp2_cp2": "cp1", "dsa_cp2_ring": "dsa_cp1",
             "dsa_cp2_all_gather": "dsa_cp1", "dsa_tp2sp_cp2": "dsa_cp1", "gdn_cp2_ring": "gdn_cp1",
             "gdn_cp4_ring": "gdn_cp1", "gdn_tp2sp_cp2": "gdn_cp1", "gdn_pp2_cp2": "gdn_cp1",
             "kda_cp2_ring": "kda_cp1", "kda_tp2sp_cp2": "kda_cp1"}
PROMPTS = {"1030": 1030, "8192": 8192}
NEW_TOKENS = 6


QUICK = ("1030", "cp2_ring")  # the quick subset's (prompt, layout): the launch then builds cp1 and cp2_ring only


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, 4, *MODEL, cases=["cp1", QUICK[1]] if quick else None, timeout=900)


@pytest.mark.parametrize("prompt, layout", [pytest.param(p, layout, marks=[pytest.mark.quick] if (p, layout) == QUICK else [])
                                            for layout in REFERENCE for p in PROMPTS])
def test_cp_generation_equals_cp1(results, layout, prompt):
    ref = results[0][REFERENCE[layout]][prompt]
    assert all(results[rank][layout][prompt]["new_ids"] == ref["new_ids"] for rank in results)
    # logits exist on the last pipeline stage (every rank without PP)
    diffs = [results[rank][layout][prompt]["max_logit_rel_diff_vs_cp1"] for rank in results]
    assert any(d is not None for d in diffs) and all(d < 1e-5 for d in diffs if d is not None), diffs


@pytest.mark.parametrize("prompt, layout", [pytest.param(p, layout, marks=[pytest.mark.quick] if (p, layout) == QUICK else [])
                                            for layout in REFERENCE for p in PROMPTS])
def test_logprobs_equal_cp1s_on_every_rank(results, layout, prompt):
    """Scoring (tools/generate.py --logprobs): every prompt token's and generated token's log-prob, on every
    rank (PP stages included), within 1e-5 of CP1's; the first prompt token has none (vLLM's null)."""
    ref = results[0][REFERENCE[layout]][prompt]
    assert ref["prompt_logprobs"][0] is None and len(ref["prompt_logprobs"]) == PROMPTS[prompt]
    for rank in results:
        got = results[rank][layout][prompt]
        assert got["prompt_logprobs"][0] is None
        pairs = list(zip(got["prompt_logprobs"][1:] + got["logprobs"], ref["prompt_logprobs"][1:] + ref["logprobs"]))
        assert len(pairs) == PROMPTS[prompt] - 1 + NEW_TOKENS
        worst = max(abs(a - b) for a, b in pairs)
        assert worst <= 1e-5, (rank, worst)


@pytest.mark.parametrize("layout", ["cp1", "mqa_cp1", "win_cp1", "mla_cp1", "dsa_cp1", "gdn_cp1", "kda_cp1"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_cp1_logprobs_equal_a_full_forwards_log_softmax(results, layout, prompt):
    assert results[0][layout][prompt]["logprob_max_abs_diff_vs_full_forward"] < 1e-5


def test_sampling_draws_the_same_tokens_at_cp4(results):
    assert results[0]["cp4_hybrid"]["sampled"] == results[0]["cp1"]["sampled"]
    assert results[0]["cp1"]["sampled"] != results[0]["cp1"]["1030"]["new_ids"]  # it did sample, not argmax


@pytest.mark.parametrize("layout", ["cp1", "mqa_cp1", "win_cp1", "mla_cp1", "dsa_cp1", "gdn_cp1", "kda_cp1"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_cp1_decode_equals_full_forward(results, layout, prompt):
    assert results[0][layout][prompt]["max_logit_rel_diff_vs_full_forward"] < 1e-5


@pytest.mark.parametrize("layout", ["cp2_ring", "cp2_ulysses", "cp4_hybrid"])
def test_each_rank_holds_its_share_of_the_cache(results, layout):
    cp = {"cp2_ring": 2, "cp2_ulysses": 2, "cp4_hybrid": 4}[layout]
    full = results[0]["cp1"]["8192"]["cache_bytes"]
    for rank in range(4):
        held = results[rank][layout]["8192"]["cache_bytes"]
        assert abs(held - full / cp) <= full / 8192 * NEW_TOKENS, (rank, held, full)


def test_mla_ring_caches_the_latent(results):
    """CP2 ring: each rank holds half the tokens, as latents ((kv_lora_rank + p) values each instead of
    4 heads x (d_qk + d_v)); the CP4 hybrid (Ulysses: K/V) holds a quarter of CP1's K/V cache."""
    full = results[0]["mla_cp1"]["8192"]["cache_bytes"]
    for rank in range(4):
        held = results[rank]["mla_cp2_ring"]["8192"]["cache_bytes"]
        assert abs(held - full / 2 * MLA_LATENT_RATIO) <= full / 8192 * NEW_TOKENS * MLA_LATENT_RATIO, (rank, held, full)
        held = results[rank]["mla_cp4_hybrid"]["8192"]["cache_bytes"]
        assert abs(held - full / 4) <= full / 8192 * NEW_TOKENS, (rank, held, full)


def _full_forward_logits(trainer, ids):
    import torch

    model = trainer.model[0].module
    with torch.no_grad():
        positions = torch.arange(len(ids))
        return model(torch.tensor(ids)[None], positions[None], None)[0].float()


def worker():
    import warnings

    warnings.simplefilter("ignore")
    import torch

    from cp_ext.arguments import parse_args
    from cp_ext.inference import Generator, Sampling
    from cp_ext.training.trainer import Trainer

    opts = worker_args(sys.argv[1:])
    prompts = {name: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for name, n in PROMPTS.items()}
    results, cp1_logits = {}, {}
    for layout, flags in {name: LAYOUTS[name] for name in selected(LAYOUTS, opts)}.items():
        trainer = Trainer(parse_args(list(opts.extra) + flags))
        gen = Generator(trainer.model[0])
        results[layout] = {}
        for name, ids in prompts.items():
            out = gen.generate(ids, NEW_TOKENS, logprobs=True)
            logits = torch.stack(out.logits) if out.logits else None
            record = {"new_ids": out.new_ids, "cache_bytes": out.cache_bytes, "prefilled": out.prefilled,
                      "prompt_logprobs": out.prompt_logprobs, "logprobs": out.new_logprobs}
            if layout not in REFERENCE:
                cp1_logits[layout, name] = logits
                whole = _full_forward_logits(trainer, ids + out.new_ids[:-1])
                full = whole[len(ids) - 1:]
                record["max_logit_rel_diff_vs_full_forward"] = ((full - logits).abs().max() / full.abs().max()).item()
                # scoring: each token's log-softmax under one full forward, the prompt's and the generated ones
                every = torch.log_softmax(whole, dim=-1).gather(1, torch.tensor(ids[1:] + out.new_ids)[:, None])[:, 0]
                record["logprob_max_abs_diff_vs_full_forward"] = (every - torch.tensor(
                    out.prompt_logprobs[1:] + out.new_logprobs)).abs().max().item()
            elif out.logits:
                ref = cp1_logits[REFERENCE[layout], name]
                record["max_logit_rel_diff_vs_cp1"] = ((ref - logits).abs().max() / ref.abs().max()).item()
            else:  # a pipeline stage before the last: no logits, the tokens it was sent
                record["max_logit_rel_diff_vs_cp1"] = None
            results[layout][name] = record
        if layout in ("cp1", "cp4_hybrid"):  # sampling: the same seed draws the same tokens at any layout
            sampled = gen.generate(prompts["1030"], NEW_TOKENS, Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=3))
            results[layout]["sampled"] = sampled.new_ids
    write_results(opts.results_dir, results)


if __name__ == "__main__":
    worker()
