"""tools/convert_hf.py import and export of DeepSeek-V4 (`cp_ext.hf.deepseek_v4`), checked against transformers 5.25's
own ``DeepseekV4ForCausalLM``.

A small random model (`tests.hf.hf_models._v4_config`: sliding, CSA, HCA and CSA layers, a hash-routed first MoE
layer, hyper-connections, sinks, YaRN on the compressed layers; every zero-initialized tensor perturbed) is saved
sharded, imported, and scored by this file's worker at CP1, CP2 ring, CP4 ring, Ulysses 2 x ring 2, TP2+SP and EP2: a
full forward of 64 tokens in the training layout. Two cases per grid:

* one document: a 50-token prompt and the 14 tokens transformers' ``generate`` picks greedily after it (its V4 cache
  and compressor states); every position's log-probabilities equal transformers' log_softmax of its fp32 logits
  within 1e-4, and cp_ext's argmax at the last 14 prompt positions are the generated tokens. cp_ext's generator
  (its CP-sharded cache) generates the same 14 tokens after the prompt, with the same log-probs. 64 tokens: 8 HCA blocks
  complete, and from token 16 on the indexer keeps 3 of more than 3 CSA entries.
* two packed documents (40 + 24 tokens, ``--reset-attention-mask``, positions restarting): each document's
  log-probabilities equal transformers' on that document alone.

The release's quantized form (FP8 with UE8M0 block scales, FP4 routed experts: ``X.weight`` + ``X.scale``) is
quantized here as the release is, imported dequantized and scored on the same launches (CP1, CP2, CP4) against
transformers on the dequantized weights; its export is the unquantized model.

transformers' indexer breaks score ties by its ``topk`` kernel and cp_ext by position; with 16 random indexer heads
no score is exactly 0 here (`test_indexer_scores_have_no_ties`). Export gives every tensor back bit for bit, in
shards transformers loads with no missing or unexpected key. Configs the flags cannot express are named.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.hf.logprob_grids import (check_export_bit_for_bit, check_generation, check_logprobs,  # noqa: E402
                                     draw_inputs, run_worker, scores_getter)
from tests.launch import REPO_ROOT, run_script  # noqa: E402

TOOL = REPO_ROOT / "tools" / "convert_hf.py"
FAMILY = "deepseek_v4"
LENGTH, NEW_TOKENS, DOCUMENTS = 64, 14, (40, 24)
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
GRIDS = {  # name: (ranks, flags)
    "cp1": (1, []),
    "cp2_ring": (2, CP2),
    "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "cp4_ring": (4, CP4),
    "cp4_u2r2": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
}
QUICK = ("cp2_ring",)
RELEASE = "deepseek_v4_fp8_fp4"  # the release's quantized form, scored on the same launches


# ----------------------------------------------------------------------------- worker
def worker():
    """Every grid's log-probs (`tests.hf.logprob_grids.run_worker`); packed documents restart their positions."""
    run_worker(sys.argv[1:], GRIDS, ["--seq-length", str(LENGTH), "--device", "cpu", "--reset-attention-mask",
                                     "--reset-position-ids"], per_document_positions=True, generate=NEW_TOKENS)


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, checkpoint dir, transformers model, token ids, reference log-probs)}."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf.hf_models import V4_SHARDS, save_quantized, tiny_hf, v4_release_target

    root = tmp_path_factory.mktemp("deepseek_v4")
    hf, ckpt = root / "hf", root / "ckpt"
    tiny_hf(FAMILY).save_pretrained(hf, max_shard_size=V4_SHARDS[FAMILY])
    proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    assert "convert_hf:" in proc.stdout, proc.stdout[-2000:]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids, reference = draw_inputs(model, LENGTH, NEW_TOKENS, DOCUMENTS)
    # the release's quantized form: FP8 (UE8M0 8 x 8 blocks) projections, FP4 routed experts (32 columns a scale:
    # their ffn 32 here); the reference is transformers on the dequantized weights
    release_hf, release_ckpt = root / "release", root / "release_ckpt"
    release, dequantized = save_quantized(tiny_hf(FAMILY, moe_intermediate_size=32), release_hf, v4_release_target,
                                          "fp8", (8, 8), FAMILY)
    run_script(0, TOOL, "import", "--hf-dir", release_hf, "--save", release_ckpt)
    release_ids, release_reference = draw_inputs(release, LENGTH, NEW_TOKENS, DOCUMENTS)
    return {FAMILY: (hf, ckpt, model, ids, reference),
            RELEASE: (release_hf, release_ckpt, release, release_ids, release_reference, dequantized)}


@pytest.fixture(scope="module")
def scores(converted, tmp_path_factory, quick):
    inputs = tmp_path_factory.mktemp("deepseek_v4_inputs") / "inputs.json"
    return scores_getter(__file__, GRIDS, converted, inputs, quick)


@pytest.mark.parametrize("grid", [pytest.param(g, marks=[pytest.mark.quick] if g in QUICK else []) for g in GRIDS])
def test_logprobs_equal_transformers(converted, scores, grid):
    _, _, _, ids, reference = converted[FAMILY]
    check_logprobs(scores(grid, FAMILY), reference, ids, NEW_TOKENS)


@pytest.mark.parametrize("grid", [pytest.param(g, marks=[pytest.mark.quick] if g in QUICK else []) for g in GRIDS])
def test_generation_equals_transformers(converted, scores, grid):
    """tools/generate.py's generator (`cp_ext.inference.Generator`) on the imported checkpoint: after the 50-token
    prompt (a tail decoded token by token at CP2 and CP4) the 14 tokens transformers' ``generate`` picks, and every
    log-prob within 1e-4 of transformers'; decoding completes CSA and HCA blocks (the cache forms their entries)."""
    _, _, _, ids, reference = converted[FAMILY]
    check_generation(scores(grid, FAMILY), reference, ids, NEW_TOKENS)


@pytest.mark.parametrize("grid", ["cp1", "cp2_ring", "cp4_ring"])
def test_quantized_release_imports_dequantized(converted, scores, grid):
    """DeepSeek-V4's release format (``X.weight`` + ``X.scale``: FP8 with UE8M0 block scales, FP4 routed experts)
    imports dequantized: log-probs equal transformers' on the dequantized weights."""
    _, _, _, ids, reference, _ = converted[RELEASE]
    check_logprobs(scores(grid, RELEASE), reference, ids, NEW_TOKENS)
    check_generation(scores(grid, RELEASE), reference, ids, NEW_TOKENS)


def test_quantized_release_exports_unquantized(converted, tmp_path):
    """The export writes the dequantized weights (no scales, no quantization_config) in the release's names."""
    import json

    import torch
    from safetensors.torch import load_file

    _, ckpt, _, _, _, dequantized = converted[RELEASE]
    out = tmp_path / "exported"
    proc = run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out)
    assert "config.json's fp8 quantization_config dropped" in proc.stdout
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(dequantized)
    assert all(torch.equal(exported[k], t) for k, t in dequantized.items())


def test_indexer_scores_have_no_ties(converted):
    """No CSA indexer score of the one-document case is exactly 0, and no query's k-th and (k+1)-th scores are within
    1e-6 relative: transformers' kernel tie-breaking cannot differ from cp_ext's rule here."""
    import torch

    _, _, model, ids, _ = converted[FAMILY]
    gaps = []

    def record(module, args, output):
        scores = output[0]  # [S, T]
        top = scores.sort(dim=-1, descending=True).values
        k = model.config.index_topk
        if top.shape[-1] > k:
            gaps.append(((top[:, k - 1] - top[:, k]).abs() / top[:, k - 1].abs().clamp_min(1e-30)).min().item())
        assert (scores != 0).all()

    hooks = [layer.self_attn.compressor.indexer.scorer.register_forward_hook(record)
             for layer in model.model.layers if getattr(layer.self_attn.compressor, "indexer", None) is not None]
    try:
        with torch.no_grad():
            model(torch.tensor(ids["one_document"])[None])
    finally:
        for hook in hooks:
            hook.remove()
    assert gaps and min(gaps) > 1e-6, gaps


def test_export_gives_every_tensor_back_bit_for_bit(converted, tmp_path):
    """HF -> cp_ext -> HF: the same names, dtypes (the int64 hash table too) and bits, in shards transformers loads."""
    hf, ckpt = converted[FAMILY][:2]
    check_export_bit_for_bit(TOOL, hf, ckpt, tmp_path / "exported", "60KB")


def test_model_yaml_carries_v4s_flags(converted):
    text = (converted[FAMILY][1] / "model.yaml").read_text()
    for line in ('experimental-attention-variant: "dsv4_hybrid"', 'csa-compress-ratios: "[0,4,8,4]"',
                 'csa-compress-ratio-for-h: "8"', 'csa-window-size: "8"', 'csa-compress-rotary-base: "160000.0"',
                 'o-groups: "2"', 'o-lora-rank: "8"', 'dsa-indexer-topk: "3"', 'enable-hyper-connections: true',
                 'moe-n-hash-layers: "1"', 'moe-router-score-function: "sqrtsoftplus"', 'rope-type: "yarn"',
                 'activation-func-clamp-value: "1.0"'):
        assert line in text, text


def _problems(**changes):
    from cp_ext.hf.families import adapter_for
    from tests.hf.hf_models import _v4_config

    config = dict(_v4_config().to_dict(), architectures=["DeepseekV4ForCausalLM"])
    config.update(changes)
    return "; ".join(adapter_for(config, "config.json").problems())


@pytest.mark.quick
@pytest.mark.parametrize("changes, must_name", [
    ({}, []),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, ["hash-routed layers must come first"]),
    ({"scoring_func": "softmax"}, ["scoring_func 'softmax'"]),
    ({"norm_topk_prob": False}, ["norm_topk_prob false"]),
    ({"hc_eps": 1e-5}, ["hc_eps 1e-05"]),
    ({"attention_bias": True}, ["attention_bias true"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
], ids=["release", "hash-order", "score", "normalize", "hc-eps", "bias", "activation"])
def test_config_the_flags_cannot_express_is_named(changes, must_name):
    problems = _problems(**changes)
    if not must_name:
        assert problems == ""
    for text in must_name:
        assert text in problems, problems


if __name__ == "__main__":
    worker()
