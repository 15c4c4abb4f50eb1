"""tools/convert_hf.py import and export of the Gated DeltaNet hybrids (`cp_ext.hf.qwen3_next`), checked against
transformers' own Qwen3-Next and Qwen3.5-MoE code.

Two small random models (`tests.hf.hf_models`, `_linear_config`: every layer type present, linear and softmax
attention, dense and MoE MLPs, the shared expert's gate; Qwen3-Next sharded with an index, Qwen3.5-MoE one
file with tied embeddings) are imported, then scored by this file's worker at CP1, CP2 ring, CP2 all-gather
(the softmax layers'), CP4 ring, Ulysses 2 x ring 2 (the linear layers' heads over Ulysses too), TP2+SP and EP2: a
full
forward of 192 tokens, three of GDN's 64-token chunks, in the training layout (each CP rank its zigzag shard).
Two cases per model and grid:

* one document: a 184-token prompt and the 8 tokens transformers' ``generate`` picks greedily after it (its
  recurrent GDN cache); every position's log-probabilities over the whole vocabulary equal transformers'
  log_softmax of its fp32 logits within 1e-4, and cp_ext's argmax at the last 8 prompt positions are the
  generated tokens (teacher-forced greedy decoding: cp_ext's generation has no GDN decode step);
* two packed documents (120 + 72 tokens, document ids and per-document positions as --reset-attention-mask
  --reset-position-ids give them): each document's log-probabilities equal transformers' on that document
  alone (transformers' packed path drops cu_seq_lens, so it is not the reference).

Measured: 2e-5 at most (whole rows, every grid). The tolerance has teeth (CP1, one change each): the gated norm
stored as w instead of w - 1 moves the log-probs by 3.0, the query and gate rows swapped 3.1, in_proj_qkvz cut
without its per-key-head grouping 3.7, the whole head rotated (--rotary-percent 1) 1.7, the shared expert's gate
zeroed 0.96.

Launches: the two imports and two exports (``python tools/convert_hf.py``), and the worker once per world size
(1, 2, 4), every grid of that size and both models in it; the multimodal release's import and export; one import
refused. Export gives every tensor back bit for bit in shards transformers loads with no missing or unexpected
key. A Qwen3_5MoeForConditionalGeneration imports its language model and exports it as a Qwen3_5MoeForCausalLM.
The releases' config.json give the releases' flags; configs the flags cannot express are named.
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
FAMILIES = {"qwen3_next": "40KB", "qwen3_5_moe": None}  # how each is saved: sharded at that size, or one file
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
QUICK = ("qwen3_next", "cp2_ring")  # the quick subset's case (pytest -m quick)


# ----------------------------------------------------------------------------- worker
def worker():
    """Every grid's log-probs (`tests.hf.logprob_grids.run_worker`); RoPE at each packed document's own positions."""
    run_worker(sys.argv[1:], GRIDS, ["--seq-length", str(LENGTH), "--reset-position-ids", "--device", "cpu"],
               per_document_positions=True)


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, checkpoint dir, transformers model, token ids)}: each model saved, imported, and its
    inputs drawn (one document of LENGTH tokens ending in transformers' greedy tokens; two documents)."""
    from tests.hf.hf_models import tiny_hf

    root = tmp_path_factory.mktemp("qwen3_next")
    out = {}
    for family, shard in FAMILIES.items():
        model = tiny_hf(family)
        hf, ckpt = root / f"{family}_hf", root / f"{family}_ckpt"
        model.save_pretrained(hf, **({"max_shard_size": shard} if shard else {}))
        proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
        assert "convert_hf:" in proc.stdout, proc.stdout[-2000:]
        ids, reference = draw_inputs(model, LENGTH, NEW_TOKENS, DOCUMENTS)
        out[family] = (hf, ckpt, model, ids, reference)
    assert (out["qwen3_next"][0] / "model.safetensors.index.json").exists()  # the sharded case is sharded
    return out


@pytest.fixture(scope="module")
def scores(converted, tmp_path_factory, quick):
    """``scores(grid, family)``: cp_ext's {case: log-probs [s, vocab]} (`tests.hf.logprob_grids.scores_getter`)."""
    inputs = tmp_path_factory.mktemp("qwen3_next_inputs") / "inputs.json"
    return scores_getter(__file__, GRIDS, converted, inputs, quick)


@pytest.mark.parametrize("family, grid", [pytest.param(f, g, marks=[pytest.mark.quick] if (f, g) == QUICK else [])
                                          for f in FAMILIES for g in GRIDS])
def test_logprobs_equal_transformers(converted, scores, family, grid):
    _, _, _, ids, reference = converted[family]
    check_logprobs(scores(grid, family), reference, ids, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_every_tensor_back_bit_for_bit(converted, family, tmp_path):
    """HF -> cp_ext -> HF: the same names, dtypes and bits (the gated norm's w - 1 and back included), in shards
    with an index that transformers' from_pretrained loads with no missing or unexpected key."""
    hf, ckpt = converted[family][:2]
    check_export_bit_for_bit(TOOL, hf, ckpt, tmp_path / "exported", "40KB")


def test_model_yaml_carries_the_families_flags(converted):
    next_, qwen35 = ((converted[f][1] / "model.yaml").read_text() for f in FAMILIES)
    for line in ('experimental-attention-variant: "gated_delta_net"', 'linear-attention-freq: "2"',
                 'linear-num-key-heads: "2"', 'linear-num-value-heads: "4"', 'linear-key-head-dim: "8"',
                 'linear-value-head-dim: "8"', 'linear-conv-kernel-dim: "4"', 'attention-output-gate: true',
                 'apply-layernorm-1p: true', 'qk-layernorm: true', 'kv-channels: "16"', 'rotary-percent: "0.25"',
                 'moe-layer-freq: "[0,1,1,1]"', 'moe-shared-expert-intermediate-size: "24"',
                 'moe-shared-expert-gate: true', 'moe-router-pre-softmax: true',
                 'untie-embeddings-and-output-weights: true'):
        assert line in next_, next_
    for line in ('linear-attention-freq: "[0,1,1,0]"', 'moe-layer-freq: "1"', 'rotary-percent: "0.5"'):
        assert line in qwen35, qwen35
    for flag in ("moe-router-pre-softmax", "untie-embeddings-and-output-weights"):
        assert f"{flag}:" not in qwen35, qwen35



def test_multimodal_release_imports_its_language_model(converted, tmp_path):
    """A Qwen3_5MoeForConditionalGeneration checkpoint (the config in text_config, the language model under
    model.language_model., a vision tower) imports its language model with the flags of the Qwen3_5MoeForCausalLM
    import (untied: transformers ties by the top-level key), the vision tower left out by design; the export is
    that language model bit for bit under the same names, with text_config as a Qwen3_5MoeForCausalLM config that
    transformers loads with no missing or unexpected key and that scores text as the multimodal model does."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.hf.hf_models import tiny_qwen3_5_moe_multimodal

    model = tiny_qwen3_5_moe_multimodal()
    hf, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    model.save_pretrained(hf)
    run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    flags = (ckpt / "model.yaml").read_text().splitlines()[1:]
    text_flags = (converted["qwen3_5_moe"][1] / "model.yaml").read_text().splitlines()[1:]
    assert sorted(flags) == sorted(text_flags + ["untie-embeddings-and-output-weights: true"]), flags
    run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out)
    original, exported = load_file(hf / "model.safetensors"), {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(k for k in original if not k.startswith("model.visual."))
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForCausalLM"]
    text_model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(text_model).__name__ == "Qwen3_5MoeForCausalLM" and not any(info.values()), info
    ids = torch.tensor(converted["qwen3_5_moe"][3]["one_document"])[None]
    with torch.no_grad():
        assert (text_model.eval()(ids).logits - model(input_ids=ids).logits).abs().max() <= 1e-5


def _config_problems(family, **changes):
    from transformers import AutoConfig

    from cp_ext.hf.families import adapter_for
    from tests.hf.hf_models import _config

    config = _config(family).to_dict()
    config["architectures"] = [AutoConfig.for_model(config["model_type"]).__class__.__name__.replace(
        "TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None or k not in changes}
    return "; ".join(adapter_for(config, "config.json").problems())


@pytest.mark.quick
@pytest.mark.parametrize("family, changes, must_name", [
    ("qwen3_next", {}, []),
    ("qwen3_5_moe", {}, []),
    ("qwen3_next", {"attention_bias": True}, ["attention_bias true"]),
    ("qwen3_next", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     ["rope type 'yarn' cannot be expressed"]),
    ("qwen3_next", {"layer_types": ["linear_attention", "sliding_attention"] * 2},
     ["layer_types cannot be expressed", "unknown: ['sliding_attention']"]),
    ("qwen3_5_moe", {"layer_types": ["linear_attention"] * 3}, ["layer_types cannot be expressed", "(got 3)"]),
    ("qwen3_5_moe", {"layer_types": ["full_attention"] * 4}, ["no 'linear_attention' layer"]),
    ("qwen3_next", {"layer_types": None, "full_attention_interval": 0}, ["full_attention_interval 0"]),
    ("qwen3_next", {"linear_conv_kernel_dim": 0}, ["linear_conv_kernel_dim 0", "--linear-conv-kernel-dim"]),
    ("qwen3_next", {"linear_num_value_heads": 3}, ["linear_num_value_heads 3 is not a multiple of "
                                                   "linear_num_key_heads 2"]),
    ("qwen3_next", {"linear_key_head_dim": None}, ["linear_key_head_dim is missing"]),
    ("qwen3_5_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     ["partial_rotary_factor 0.3", "--rotary-percent"]),
    ("qwen3_next", {"shared_expert_intermediate_size": 0}, ["shared_expert_intermediate_size 0"]),
    ("qwen3_next", {"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
], ids=["qwen3_next", "qwen3_5_moe", "attention-bias", "rope-type", "layer-type", "layer-count", "no-linear-layer",
        "interval", "conv-kernel", "value-heads", "missing-size", "partial-rotary", "shared-expert", "activation"])
def test_config_megatron_cannot_express_is_named(family, changes, must_name):
    """Each config.json value the flags cannot reproduce is a problem naming the key and the value (the messages
    tools/convert_hf.py reports, as test_bad_input_is_one_message shows), never a silently different model."""
    text = _config_problems(family, **changes)
    assert (text == "") == (not must_name), text
    for part in must_name:
        assert part in text, text


# The releases' config.json as published (Qwen3-Next-80B-A3B: transformers 4.x's top-level rope keys and
# full_attention_interval; Qwen3.5: the multimodal layout, mrope keys in rope_parameters), fewer layers.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 8, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_5_MOE = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {
        "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "num_attention_heads": 16, "num_experts": 256,
        "num_experts_per_tok": 8, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "shared_expert_intermediate_size": 512, "vocab_size": 248320},
    "vision_config": {"depth": 27, "hidden_size": 1152}}


@pytest.mark.quick
@pytest.mark.parametrize("config, expected", [
    (QWEN3_NEXT_80B, {"--linear-attention-freq": 4, "--rotary-base": 10000000, "--rotary-percent": 0.25,
                      "--kv-channels": 256, "--num-query-groups": 2, "--num-experts": 512, "--moe-router-topk": 10,
                      "--moe-layer-freq": 1, "--moe-shared-expert-intermediate-size": 512, "--ffn-hidden-size": 5120,
                      "--linear-num-value-heads": 32, "--norm-epsilon": 1e-06}),
    (QWEN3_5_MOE, {"--linear-attention-freq": 4, "--rotary-base": 10000000, "--rotary-percent": 0.25,
                   "--num-experts": 256, "--moe-router-topk": 8, "--moe-layer-freq": 1, "--vocab-size": 248320}),
], ids=["qwen3_next_80b", "qwen3_5_moe"])
def test_release_configs_give_the_release_flags(config, expected):
    from cp_ext.hf.families import adapter_for

    adapter = adapter_for(config, "config.json")
    assert adapter.problems() == []
    flags = adapter.flags()
    given = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if str(flag).startswith("--")}
    assert {flag: given.get(flag) for flag in expected} == expected
    for flag in ("--attention-output-gate", "--apply-layernorm-1p", "--qk-layernorm", "--moe-shared-expert-gate",
                 "--untie-embeddings-and-output-weights"):
        assert flag in flags
    assert "--moe-router-pre-softmax" not in flags
    assert adapter.unused_by_design({"mtp.fc.weight", "model.visual.blocks.0.attn.qkv.weight"}) == (
        {"mtp.fc.weight", "model.visual.blocks.0.attn.qkv.weight"} if "text_config" in config else {"mtp.fc.weight"})


def test_bad_input_is_one_message(converted, tmp_path):
    """Every problem at once, in one message: a rope type the flags cannot express, and a conv whose taps are not
    config.json's linear_conv_kernel_dim (the tensor's shape against the one config.json implies); nothing is
    left behind."""
    hf = tmp_path / "hf"
    shutil.copytree(converted["qwen3_5_moe"][0], hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(linear_conv_kernel_dim=3, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    (hf / "config.json").write_text(json.dumps(config))
    proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", tmp_path / "ckpt", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("convert_hf.py: configuration error") == 1
    for text in ("rope type 'yarn' cannot be expressed",
                 "model.layers.1.linear_attn.conv1d.weight has shape (64, 1, 4), config.json implies (64, 1, 3)"):
        assert text in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


if __name__ == "__main__":
    worker()
