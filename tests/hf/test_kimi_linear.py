"""tools/convert_hf.py import and export of Kimi-Linear (`cp_ext.hf.kimi_linear`), checked against transformers 5.25's
own ``KimiLinearForCausalLM``.

Two small random models (`tests.hf.hf_models`, `_kimi_config`: KDA and NoPE MLA layers, a dense first layer or none,
sigmoid-routed experts with the correction bias and shared experts) are imported, then scored by this file's worker at
CP1, CP2 ring, CP2 all-gather (the MLA layers'), CP4 ring, Ulysses 2 x ring 2, TP2+SP and EP2: a full forward of 192
tokens, three of KDA's 64-token chunks, in the training layout (each CP rank its zigzag shard; at CP > 1 and TP 1
the MLA layers exchange the latent). ``kimi_linear`` is the release's layout (no q-LoRA, rms_norm_eps 1e-5 against
the latent norm's 1e-6) saved as transformers saves a bf16 model: bf16, its router, correction bias and dt_bias in fp32, sharded;
``kimi_linear_q_lora`` (q-LoRA, group-limited routing, MoE on every layer, the 0/1 layer list) is fp32, one file.
Two cases per model and grid:

* one document: a 184-token prompt and the 8 tokens transformers' ``generate`` picks greedily after it (its
  recurrent KDA cache); every position's log-probabilities over the whole vocabulary equal transformers'
  log_softmax of its fp32 logits (the weights read in fp32) within 1e-4, and cp_ext's argmax at the last 8 prompt
  positions are the generated tokens (teacher-forced greedy decoding: cp_ext's generation has no KDA decode step);
* two packed documents (120 + 72 tokens, document ids as --reset-attention-mask gives them; no positions: the model
  has none): each document's log-probabilities equal transformers' on that document alone.

Measured: 1.2e-5 at most (whole rows, every grid). The tolerance has teeth (``kimi_linear`` at CP1, one change to
the import each): the latent rows left unscaled (megatron's latent norm then takes eps 1e-5) moves the log-probs by
1.8, the query and key convs swapped 3.5, o_norm's w stored as w - 1 (a zero-centered reading) 3.8, the correction
bias dropped 3.2, w1 and w3 swapped 1.9.

Launches: the two imports and two exports (``python tools/convert_hf.py``), the worker once per world size (1, 2,
4), every grid of that size and both models in it; one import refused. Export gives every tensor back bit for bit,
in the dtype and under the name the import read, in shards transformers loads with no missing or unexpected key.
The release's config.json gives the release's flags; configs the flags cannot express are named.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.hf.logprob_grids import (check_export_bit_for_bit, check_logprobs, draw_inputs, run_worker,  # noqa: E402
                                     scores_getter)
from tests.launch import REPO_ROOT, run_script  # noqa: E402

TOOL = REPO_ROOT / "tools" / "convert_hf.py"
FAMILIES = {"kimi_linear": "40KB", "kimi_linear_q_lora": None}  # how each is saved: sharded at that size, or one file
BF16 = ("kimi_linear",)  # saved as transformers saves a bf16 model (the release's dtype)
LENGTH, NEW_TOKENS, DOCUMENTS = 192, 8, (120, 72)
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
GRIDS = {  # name: (ranks, flags)
    "cp1": (1, []),
    "cp2_ring": (2, CP2),
    "cp2_all_gather": (2, CP2 + ["--cp-comm-type", "all_gather"]),
    "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "cp4_ring": (4, CP4),
    "cp4_u2r2": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
}
QUICK = ("kimi_linear", "cp2_ring")  # the quick subset's case (pytest -m quick)


# ----------------------------------------------------------------------------- worker
def worker():
    """Every grid's log-probs (`tests.hf.logprob_grids.run_worker`); a NoPE model: no positions to reset."""
    run_worker(sys.argv[1:], GRIDS, ["--seq-length", str(LENGTH), "--device", "cpu"], per_document_positions=False)


# ----------------------------------------------------------------------------- pytest
def _save(family, directory, scratch):
    """The tiny model saved as a release would be: bf16 ones as transformers saves a model loaded in bf16 (its
    router, correction bias and dt_bias stay fp32), sharded where `FAMILIES` says."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf.hf_models import tiny_hf

    model, shard = tiny_hf(family), FAMILIES[family]
    if family in BF16:
        model.save_pretrained(scratch)
        model = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.bfloat16)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, checkpoint dir, transformers model in fp32, token ids, reference log-probs)}: each model
    saved, imported, read back by transformers in fp32, and its inputs drawn."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("kimi_linear")
    out = {}
    for family in FAMILIES:
        hf, ckpt = root / f"{family}_hf", root / f"{family}_ckpt"
        _save(family, hf, root / f"{family}_fp32")
        proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
        assert "convert_hf:" in proc.stdout, proc.stdout[-2000:]
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        ids, reference = draw_inputs(model, LENGTH, NEW_TOKENS, DOCUMENTS)
        out[family] = (hf, ckpt, model, ids, reference)
    assert (out["kimi_linear"][0] / "model.safetensors.index.json").exists()  # the sharded case is sharded
    return out


@pytest.fixture(scope="module")
def scores(converted, tmp_path_factory, quick):
    """``scores(grid, family)``: cp_ext's {case: log-probs [s, vocab]} (`tests.hf.logprob_grids.scores_getter`)."""
    inputs = tmp_path_factory.mktemp("kimi_linear_inputs") / "inputs.json"
    return scores_getter(__file__, GRIDS, converted, inputs, quick)


@pytest.mark.parametrize("family, grid", [pytest.param(f, g, marks=[pytest.mark.quick] if (f, g) == QUICK else [])
                                          for f in FAMILIES for g in GRIDS])
def test_logprobs_equal_transformers(converted, scores, family, grid):
    _, _, _, ids, reference = converted[family]
    check_logprobs(scores(grid, family), reference, ids, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_every_tensor_back_bit_for_bit(converted, family, tmp_path):
    """HF -> cp_ext -> HF: the same names (a dense layer under ``block_sparse_moe.``, as transformers saved it), dtypes
    (bf16, and the fp32 tensors beside them) and bits (the latent rows scaled by sqrt(10) in fp32 and back included),
    in shards with an index that transformers' from_pretrained loads with no missing or unexpected key."""
    import torch

    hf, ckpt = converted[family][:2]
    original = check_export_bit_for_bit(TOOL, hf, ckpt, tmp_path / "exported", "40KB")
    assert {t.dtype for t in original.values()} == ({torch.bfloat16, torch.float32} if family in BF16
                                                    else {torch.float32})


def test_model_yaml_carries_the_families_flags(converted):
    release, q_lora = ((converted[f][1] / "model.yaml").read_text() for f in FAMILIES)
    for line in ('experimental-attention-variant: "kda"', 'linear-attention-freq: "2"', 'linear-num-key-heads: "2"',
                 'linear-num-value-heads: "2"', 'linear-key-head-dim: "8"', 'linear-value-head-dim: "8"',
                 'linear-conv-kernel-dim: "4"', 'multi-latent-attention: true', 'kv-lora-rank: "16"',
                 'qk-head-dim: "8"', 'qk-pos-emb-head-dim: "4"', 'v-head-dim: "8"', 'qk-layernorm: true',
                 'no-rope-freq: "1"', 'position-embedding-type: "none"', 'rope-type: "rope"', 'norm-epsilon: "1e-05"',
                 'moe-layer-freq: "[0,1,1,1]"', 'moe-router-score-function: "sigmoid"',
                 'moe-router-enable-expert-bias: true', 'moe-router-topk-scaling-factor: "2.446"',
                 'moe-shared-expert-intermediate-size: "16"', 'untie-embeddings-and-output-weights: true'):
        assert line in release, release
    for flag in ("q-lora-rank", "apply-layernorm-1p", "moe-router-num-groups"):
        assert f"{flag}:" not in release, release
    for line in ('linear-attention-freq: "[0,1,1,0]"', 'q-lora-rank: "12"', 'moe-layer-freq: "1"',
                 'norm-epsilon: "1e-06"', 'moe-router-num-groups: "2"', 'moe-router-group-topk: "1"',
                 'moe-shared-expert-intermediate-size: "32"'):
        assert line in q_lora, q_lora


def _config_problems(family, **changes):
    from cp_ext.hf.families import adapter_for
    from tests.hf.hf_models import _config

    config = dict(_config(family).to_dict(), architectures=["KimiLinearForCausalLM"])
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None or k not in changes}
    return "; ".join(adapter_for(config, "config.json").problems())


@pytest.mark.quick
@pytest.mark.parametrize("family, changes, must_name", [
    ("kimi_linear", {}, []),
    ("kimi_linear_q_lora", {}, []),
    ("kimi_linear", {"attention_bias": True}, ["attention_bias true"]),
    ("kimi_linear", {"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ("kimi_linear", {"num_key_value_heads": 2}, ["num_key_value_heads 2 != num_attention_heads 4"]),
    ("kimi_linear", {"layer_types": ["linear_attention", "sliding_attention"] * 2},
     ["layer_types cannot be expressed", "unknown or unset: ['sliding_attention']"]),
    ("kimi_linear", {"layer_types": ["full_attention"] * 4}, ["no 'linear_attention' layer"]),
    ("kimi_linear", {"layer_types": None, "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2]}},
     ["kda_layers / full_attn_layers cannot be expressed", "unknown or unset: ['None']"]),
    ("kimi_linear", {"linear_attn_config": {"gate_lower_bound": -5.0}}, ["linear_attn_config gate_lower_bound -5.0"]),
    ("kimi_linear", {"mla_use_nope": False}, ["mla_use_nope false"]),
    ("kimi_linear", {"rms_norm_eps": 0}, ["rms_norm_eps 0"]),
    ("kimi_linear", {"linear_conv_kernel_dim": 0}, ["linear_conv_kernel_dim 0"]),
    ("kimi_linear", {"kv_lora_rank": None}, ["kv_lora_rank is missing"]),
    ("kimi_linear", {"mlp_layer_types": ["dense", "latent"] * 2}, ["mlp_layer_types cannot be expressed"]),
    ("kimi_linear", {"mlp_layer_types": None, "moe_layer_freq": 2}, ["moe_layer_freq 2"]),
    ("kimi_linear", {"moe_renormalize": False}, ["moe_renormalize False with num_experts_per_token 2"]),
    ("kimi_linear", {"moe_router_activation_func": "softmax"}, ["moe_router_activation_func 'softmax'"]),
    ("kimi_linear", {"num_shared_experts": 0}, ["num_shared_experts 0"]),
    ("kimi_linear_q_lora", {"num_experts_per_token": 4}, ["num_experts_per_token 4 / topk_group 1 != 2"]),
    ("kimi_linear_q_lora", {"num_expert_group": 3}, ["num_expert_group 3 / topk_group 1"]),
], ids=["kimi_linear", "kimi_linear_q_lora", "attention-bias", "activation", "kv-heads", "layer-type", "no-kda-layer",
        "layer-list-gap", "gate-lower-bound", "rope", "eps", "conv-kernel", "missing-size", "mlp-type", "moe-freq",
        "renormalize", "router-activation", "shared-experts", "group-topk", "groups"])
def test_config_megatron_cannot_express_is_named(family, changes, must_name):
    """Each config.json value the flags cannot reproduce is a problem naming the key and the value (the messages
    tools/convert_hf.py reports, as test_bad_input_is_one_message shows), never a silently different model."""
    text = _config_problems(family, **changes)
    assert (text == "") == (not must_name), text
    for part in must_name:
        assert part in text, text


# Kimi-Linear-48B-A3B's config.json as released (its modeling code's key names, linear_attn_config 1-based)
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "kv_lora_rank": 512, "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26], "num_heads": 32,
        "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840}


@pytest.mark.quick
def test_release_config_gives_the_release_flags():
    from cp_ext.hf.families import adapter_for

    adapter = adapter_for(KIMI_LINEAR_48B, "config.json")
    assert adapter.problems() == []
    flags = adapter.flags()
    given = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if str(flag).startswith("--")}
    expected = {"--num-layers": 27, "--hidden-size": 2304, "--ffn-hidden-size": 9216, "--norm-epsilon": 1e-05,
                "--max-position-embeddings": 1048576, "--vocab-size": 163840, "--num-attention-heads": 32,
                "--kv-lora-rank": 512, "--qk-head-dim": 128, "--qk-pos-emb-head-dim": 64, "--v-head-dim": 128,
                "--linear-attention-freq": "[1,1,1,0,1,1,1,0,1,1,1,0,1,1,1,0,1,1,1,0,1,1,1,0,1,1,0]",
                "--linear-num-key-heads": 32, "--linear-num-value-heads": 32, "--linear-key-head-dim": 128,
                "--linear-value-head-dim": 128, "--linear-conv-kernel-dim": 4, "--num-experts": 256,
                "--moe-router-topk": 8, "--moe-ffn-hidden-size": 1024, "--moe-layer-freq": "[0" + ",1" * 26 + "]",
                "--moe-router-topk-scaling-factor": 2.446, "--moe-shared-expert-intermediate-size": 1024,
                "--position-embedding-type": "none", "--no-rope-freq": 1}
    assert {flag: given.get(flag) for flag in expected} == expected
    for flag in ("--multi-latent-attention", "--qk-layernorm", "--moe-router-enable-expert-bias",
                 "--untie-embeddings-and-output-weights"):
        assert flag in flags
    for flag in ("--q-lora-rank", "--moe-router-num-groups", "--apply-layernorm-1p"):
        assert flag not in flags
    assert adapter.latent_scale() == pytest.approx(10 ** 0.5)


def test_bad_input_is_one_message(converted, tmp_path):
    """Every problem at once, in one message: a config value the flags cannot express, and a conv whose taps are not
    config.json's (the tensor's shape against the one config.json implies); nothing is left behind."""
    hf = tmp_path / "hf"
    shutil.copytree(converted["kimi_linear_q_lora"][0], hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(linear_conv_kernel_dim=3, moe_router_activation_func="softmax")
    (hf / "config.json").write_text(json.dumps(config))
    proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", tmp_path / "ckpt", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("convert_hf.py: configuration error") == 1
    for text in ("moe_router_activation_func 'softmax'",
                 "model.layers.1.self_attn.q_conv1d.weight has shape (16, 1, 4), config.json implies (16, 1, 3)"):
        assert text in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


if __name__ == "__main__":
    worker()
