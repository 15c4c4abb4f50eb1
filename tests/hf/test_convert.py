"""tools/convert_hf.py import and export, checked token by token against transformers' own model code.

Small random models are built with transformers' config classes (no hub, `tests.hf.hf_models`): a
Qwen3-MoE (q/k norms, GQA with its own head dim, a dense first layer, normalized top-k routing), saved
sharded with an index, a Mixtral (GQA, softmax top-2), saved as one file, and a GPT-OSS (biases, sinks,
alternating 8-key sliding windows, the release's YaRN, stacked interleaved experts, the clamped GLU),
sharded, and a DeepSeek-V3.2 (V3's shape with a lightning indexer choosing each token's top 7 keys, its
tensors mapped onto megatron's DSA seat; no Ulysses grids: DSA refuses them), sharded;
their norms are perturbed so a dropped norm shows, GPT-OSS's biases and sinks are random. Each
is imported, and `tools/generate.py --logprobs` scores a prompt at CP1, CP2 ring, CP2 Ulysses, CP2
all_gather, CP4 = U2 x R2, TP2+SP, PP2 and EP2: every prompt token's and generated token's log-prob
equals transformers' log_softmax of its fp32 logits within 1e-4 (measured: 1e-6), and greedy tokens equal
transformers' `generate`. GPT-OSS's tolerance has teeth (measured at CP1, each change alone): no window
0.43, a window of 9 keys for 8 0.22, no sinks 0.28, a zeroed q/k/v, o_proj, router, gate_up or down
bias 0.56, 1.5, 0.26, 0.12, 0.70, no clamp 0.14, plain RoPE for YaRN 0.27, --enable-gpt-oss's YaRN
2e-3, YaRN's truncated correction range 8e-4. Export gives every tensor back bit for bit, in shards
transformers loads with no missing or unexpected key, and after 3 training steps at CP4 the exported
model's log-probs equal cp_ext's. Bad inputs are one message naming the file, the tensor or the key.
"""

import json
import shutil
import struct

import pytest

from tests.launch import REPO_ROOT, run_script
from tests.hf.hf_models import SHARDS, tiny_hf
from tests.hf.logprob_grids import check_export_bit_for_bit

TOOL, GENERATE = REPO_ROOT / "tools" / "convert_hf.py", REPO_ROOT / "tools" / "generate.py"
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."  # 62 bytes: a tail past CP2's split
GRIDS = {"cp1": (1, []), "cp2_ring": (2, ["--context-parallel-size", "2"]),
         "cp2_ulysses": (2, ["--context-parallel-size", "2", "--ulysses-size", "2"]),
         "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
         "cp2_all_gather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
         "cp4_u2r2": (4, ["--context-parallel-size", "4", "--ulysses-size", "2"]),
         "pp2": (2, ["--pipeline-model-parallel-size", "2"]), "ep2": (2, ["--expert-model-parallel-size", "2"]),

         # Megatron-LM's --use-checkpoint-args: the model flags from the checkpoint, none on the command line
         "cp2_ring_checkpoint_args": (2, ["--context-parallel-size", "2", "--use-checkpoint-args"])}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf dir, checkpoint dir, transformers model)}: one sharded save, one single-file save."""
    root = tmp_path_factory.mktemp("convert_hf")
    out = {}
    for family, shard in SHARDS.items():
        model = tiny_hf(family)
        hf = root / f"{family}_hf"
        model.save_pretrained(hf, **({"max_shard_size": shard} if shard else {}))
        ckpt = root / f"{family}_ckpt"
        proc = run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
        assert "convert_hf:" in proc.stdout, proc.stdout[-2000:]
        out[family] = (hf, ckpt, model)
    assert (out["qwen3_moe"][0] / "model.safetensors.index.json").exists()  # the sharded case is sharded
    return out


def _scores_equal_transformers(ckpt, model, nproc, flags, tmp_path):
    """`tools/generate.py --logprobs` on ``ckpt`` at a grid: every token's log-prob within 1e-4 of transformers'
    ``model``, greedy tokens its argmax."""
    import torch

    output = tmp_path / "scores.jsonl"
    model_flags = [] if "--use-checkpoint-args" in flags else ["--config", ckpt / "model.yaml"]
    run_script(nproc, GENERATE, *model_flags, "--load", ckpt, *flags, "--seq-length", "64",
               "--prompt", PROMPT, "--max-new-tokens", "4", "--logprobs", "--output", output)
    record = json.loads(output.read_text().splitlines()[0])
    ids = torch.tensor(record["prompt_ids"] + record["ids"])[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits.float()[0], dim=-1)
    reference = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
    ours = torch.tensor(record["prompt_logprobs"][1:] + record["logprobs"])
    assert record["prompt_logprobs"][0] is None and ours.shape == reference.shape
    assert (ours - reference).abs().max() <= 1e-4, (ours - reference).abs().max()
    greedy = logprobs[len(record["prompt_ids"]) - 1:].argmax(-1).tolist()
    assert record["ids"] == greedy[:len(record["ids"])]
    n = len(record["ids"])  # transformers' own greedy decoding (its KV cache), not only its argmax
    with torch.no_grad():
        generated = model.generate(torch.tensor(record["prompt_ids"])[None], max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)
    assert generated[0, -n:].tolist() == record["ids"]


# DSA runs on the ring and all-gather; Ulysses is refused at parse time (tests/arguments/test_dsa.py)
ULYSSES = {"cp2_ulysses", "cp4_u2r2"}


@pytest.mark.parametrize("family, grid", [(f, g) for f in SHARDS for g in GRIDS
                                          if not (f == "deepseek_v32" and g in ULYSSES)])
def test_logprobs_equal_transformers(converted, family, grid, tmp_path):
    _, ckpt, model = converted[family]
    nproc, flags = GRIDS[grid]
    _scores_equal_transformers(ckpt, model, nproc, flags, tmp_path)


def test_deepseek_v32_topk_boundaries_are_separated(converted, tmp_path):
    """In transformers' DeepSeek-V3.2 on the scored tokens, no query's 7th and 8th indexer scores lie within 1e-4
    (relative) of each other, nor are both 0: cp_ext choosing transformers' keys is not luck (a tie would be
    broken by position in cp_ext and by torch.topk's kernel in transformers). The scores are recomputed from
    transformers' own indexer modules and RoPE, on the inputs its forward hands them."""
    import torch
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_dsa

    hf, ckpt, model = converted["deepseek_v32"]
    output = tmp_path / "ids.jsonl"
    run_script(1, GENERATE, "--config", ckpt / "model.yaml", "--load", ckpt, "--seq-length", "64", "--prompt", PROMPT,
               "--max-new-tokens", "4", "--logprobs", "--output", output)  # --logprobs: the prompt's ids too
    record = json.loads(output.read_text().splitlines()[0])
    gaps = []

    def boundary_gaps(indexer, args):
        hidden, q_resid, (cos, sin) = args[:3]
        b, s, _ = hidden.shape
        p, k_top = indexer.qk_rope_head_dim, indexer.index_topk
        q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        q_rot, k_rot = hf_dsa.apply_rotary_pos_emb(q[..., :p], k[..., :p], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., p:]], -1), torch.cat([k_rot, k[..., p:]], -1).squeeze(2)
        per_head = torch.relu(q.float() @ k.float().transpose(-1, -2).unsqueeze(1) * indexer.softmax_scale)
        index = (indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5).unsqueeze(-2) @ per_head
        for t in range(k_top, s):
            row = index[0, t, 0, : t + 1].sort(descending=True).values
            a, c = row[k_top - 1].item(), row[k_top].item()
            gaps.append(abs(a - c) / max(abs(a), abs(c)) if (a, c) != (0.0, 0.0) else 0.0)

    hooks = [layer.self_attn.indexer.register_forward_pre_hook(boundary_gaps) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor(record["prompt_ids"] + record["ids"])[None])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(gaps) == 4 * (len(record["prompt_ids"]) + 4 - 7) and min(gaps) > 1e-4, min(gaps)


def test_deepseek_yarn_from_another_original_length_scores_as_transformers(tmp_path):
    """A DeepSeek-V3 whose YaRN starts from 32 original positions with betas 16 / 2 (the 62-token prompt
    crosses the window) imports through --yarn-original-max-position-embeddings, --yarn-beta-fast and
    --yarn-beta-slow, and scores as transformers does."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2}
    model = tiny_hf("deepseek_v3", rope_parameters=yarn)
    model.save_pretrained(tmp_path / "hf")
    run_script(0, TOOL, "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    text = (tmp_path / "ckpt" / "model.yaml").read_text()
    for line in ('yarn-original-max-position-embeddings: "32"', 'yarn-beta-fast: "16"', 'yarn-beta-slow: "2"'):
        assert line in text, text
    _scores_equal_transformers(tmp_path / "ckpt", model, 2, ["--context-parallel-size", "2"], tmp_path)


def test_gpt_oss_window_layers_as_a_list_score_as_transformers(converted, tmp_path):
    """layer_types that megatron's every-N rule cannot give (full, sliding, sliding, sliding) go as the 0/1 list;
    at PP2 too, where megatron numbers the layers globally (counted per stage, the list would give layer 3 full
    attention)."""
    from transformers import GptOssForCausalLM

    _, _, base = converted["gpt_oss"]
    config = base.config.__class__.from_dict(base.config.to_dict(), attn_implementation="eager",
                                             experts_implementation="eager")
    config.layer_types = ["full_attention"] + ["sliding_attention"] * 3
    model = GptOssForCausalLM(config).eval()
    model.load_state_dict(base.state_dict())
    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    model.save_pretrained(hf)
    run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    assert 'window-attn-skip-freq: "[0,1,1,1]"' in (ckpt / "model.yaml").read_text()
    _scores_equal_transformers(ckpt, model, *GRIDS["pp2"], tmp_path)


def test_model_yaml_carries_the_families_flags(converted):
    text = (converted["qwen3_moe"][1] / "model.yaml").read_text()
    for line in ('qk-layernorm: true', 'moe-layer-freq: "[0,1,1,1]"', 'num-query-groups: "2"', 'kv-channels: "16"',
                 'padded-vocab-size: "384"', 'untie-embeddings-and-output-weights: true'):
        assert line in text, text
    assert "moe-router-pre-softmax" not in text  # norm_topk_prob: top-k, then softmax over the k


def test_model_yaml_carries_gpt_oss_flags(converted):
    """HF's window of 8 keys is megatron's 7,0 on layers 1, 3 (1-based); the release's YaRN by its own values."""
    text = (converted["gpt_oss"][1] / "model.yaml").read_text()
    for line in ('window-size: "7,0"', 'window-attn-skip-freq: "2"', 'softmax-type: "learnable"', 'quick-geglu: true',
                 'glu-linear-offset: "1.0"', 'activation-func-clamp-value: "1.0"', 'position-embedding-type: "yarn"',
                 'rotary-scaling-factor: "32.0"', 'yarn-original-max-position-embeddings: "4096"',
                 'rotary-base: "150000"',
                 'no-yarn-correction-range-round-to-int: true', 'add-bias-linear: true', 'num-experts: "4"'):
        assert line in text, text
    for flag in ("enable-gpt-oss", "disable-bias-linear", "swiglu", "moe-router-pre-softmax"):
        assert f"{flag}:" not in text, text


def _layer_types_flags(types, window=8):
    from cp_ext.hf.gpt_oss import GptOss

    adapter = GptOss({"num_hidden_layers": len(types), "layer_types": types, "sliding_window": window,
                      "num_attention_heads": 4, "hidden_size": 32})
    return adapter.window_flags(), adapter._window_problems()


def test_layer_types_become_megatrons_window_layers():
    """megatron's --window-attn-skip-freq N windows 1-based layer % N != 0; other patterns go as the 0/1 list."""
    s, f = "sliding_attention", "full_attention"
    assert _layer_types_flags([s, f] * 3) == (["--window-size", "7,0", "--window-attn-skip-freq", 2], [])
    assert _layer_types_flags([s, s, f] * 2) == (["--window-size", "7,0", "--window-attn-skip-freq", 3], [])
    assert _layer_types_flags([f, s, s, s]) == (["--window-size", "7,0", "--window-attn-skip-freq", "[0,1,1,1]"], [])
    assert _layer_types_flags([s] * 4, window=1) == (["--window-size", "0,0"], [])
    assert _layer_types_flags([f] * 4) == ([], [])


@pytest.mark.parametrize("key, value, must_name", [
    ("layer_types", ["sliding_attention", "full_attention"], ["layer_types", "cannot be expressed", "for 4 layers"]),
    ("sliding_window", None, ["sliding_window None", "W >= 1"]),
    ("swiglu_alpha", 1.5, ["swiglu_alpha 1.5", "1.702"]),
    ("swiglu_limit", None, ["swiglu_limit None", "positive"]),
    ("num_local_experts", None, ["num_local_experts is missing"]),
    ("num_experts_per_tok", 1, ["num_experts_per_tok 1"]),
    ("attention_bias", False, ["attention_bias false"]),
    ("hidden_act", "gelu", ["hidden_act 'gelu'"]),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 150000}, ["rope type 'llama3'"]),
    ("rope_parameters", {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_theta": 150000, "attention_factor": 1.0}, ["attention_factor 1.0 differs"]),
    ("rope_parameters", {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.5}, ["rope_theta 150000.5"]),
])
def test_gpt_oss_config_megatron_cannot_express_is_named(converted, key, value, must_name):
    """Each config.json value the flags cannot reproduce is a problem naming it (the messages tools/convert_hf.py
    reports as test_bad_input_is_one_message shows), never a silently different model."""
    from cp_ext.hf.gpt_oss import GptOss

    config = json.loads((converted["gpt_oss"][0] / "config.json").read_text())
    assert GptOss(config).problems() == []
    config[key] = value
    text = "; ".join(GptOss(config).problems())
    for part in must_name:
        assert part in text, text


class _Tensors:
    """A stand-in for `HFCheckpoint`: named tensors, counting the reads."""

    def __init__(self, tensors):
        self.tensors, self.reads = tensors, {}

    def get(self, name, shape=None):
        self.reads[name] = self.reads.get(name, 0) + 1
        assert tuple(self.tensors[name].shape) == tuple(shape)
        return self.tensors[name]


def test_gpt_oss_experts_interleaved_and_stacked_both_ways():
    """HF's stacked [E, h, 2 ffn] with gate/up interleaved -> megatron's per-expert [gate; up] [2 ffn, h] (and
    the down projection transposed); each stacked tensor read once for its layer's experts; export returns {}
    until the layer's last expert, then HF's stacked tensor bit for bit."""
    import torch

    from cp_ext.hf.gpt_oss import GptOss

    experts, h, ffn = 3, 4, 2
    adapter = GptOss({"num_attention_heads": 2, "hidden_size": h, "intermediate_size": ffn,
                      "num_local_experts": experts})
    adapter.used = set()
    at = "model.layers.1.mlp.experts."
    hf = _Tensors({at + "gate_up_proj": torch.randn(experts, h, 2 * ffn),
                   at + "gate_up_proj_bias": torch.randn(experts, 2 * ffn),
                   at + "down_proj": torch.randn(experts, ffn, h), at + "down_proj_bias": torch.randn(experts, h)})
    x = torch.randn(5, h)
    exported = {}
    for e in range(experts):
        units = {part: adapter.unit(hf, f"decoder.layers.mlp.experts.experts.linear_{part}.1.{e}")
                 for part in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
        # megatron's expert: fc1 -> [gate; up] halves; HF's: x @ gate_up_proj[e] + bias, gate = [..., ::2]
        y = x @ units["fc1.weight"].t() + units["fc1.bias"]
        theirs = x @ hf.tensors[at + "gate_up_proj"][e] + hf.tensors[at + "gate_up_proj_bias"][e]
        assert torch.equal(y[:, :ffn], theirs[:, ::2]) and torch.equal(y[:, ffn:], theirs[:, 1::2])
        g = torch.randn(5, ffn)
        assert torch.allclose(g @ units["fc2.weight"].t(), g @ hf.tensors[at + "down_proj"][e])
        for part, full in units.items():
            got = adapter.split(f"decoder.layers.mlp.experts.experts.linear_{part}.1.{e}", full.clone())
            assert (got == {}) == (e < experts - 1)
            exported.update(got)
    assert hf.reads == dict.fromkeys(hf.tensors, 1)
    assert sorted(exported) == sorted(hf.tensors)
    assert all(torch.equal(exported[k], hf.tensors[k]) for k in hf.tensors)


def _edited(converted, tmp_path, family, edit):
    hf = tmp_path / "hf"
    shutil.copytree(converted[family][0], hf)
    edit(hf)
    return run_script(0, TOOL, "import", "--hf-dir", hf, "--save", tmp_path / "ckpt", check=False)


def _config(key, value):
    def edit(hf):
        config = json.loads((hf / "config.json").read_text())
        config[key] = value
        (hf / "config.json").write_text(json.dumps(config))
    return edit


def _drop_tensor(name, extra=None):
    def edit(hf):
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(hf / "model.safetensors")
        tensors.pop(name, None)
        if extra:
            tensors[extra] = torch.zeros(3)
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return edit


def _truncate(hf):
    data = (hf / "model.safetensors").read_bytes()
    header = struct.unpack("<Q", data[:8])[0]
    (hf / "model.safetensors").write_bytes(data[:8 + header + 100])  # the header, then a cut-off payload


@pytest.mark.parametrize("family, edit, must_name", [
    ("mixtral", _config("architectures", ["LlamaForCausalLM"]),
     ["architecture ['LlamaForCausalLM'] is not supported", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]),
    ("deepseek_v32", _config("architectures", ["GlmMoeDsaForCausalLM"]),
     ["architecture GlmMoeDsaForCausalLM is not supported", "interleaved", "indexer_types"]),
    ("mixtral", _drop_tensor("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
     ["model.layers.1.block_sparse_moe.experts.2.w3.weight is missing"]),
    ("mixtral", _drop_tensor("", extra="model.layers.0.extra.weight"),
     ["1 tensor(s) left over after the mapping", "model.layers.0.extra.weight"]),
    ("mixtral", _config("intermediate_size", 24), ["has shape (16, 32), config.json implies (24, 32)"]),
    ("mixtral", _truncate, ["model.safetensors", "corrupt or truncated"]),
    ("qwen3_moe", lambda hf: sorted(hf.glob("model-*.safetensors"))[-1].unlink(),
     ["model.safetensors.index.json names the shard", "which is not in"]),
    ("mixtral", _config("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
     ["rope type 'yarn' cannot be expressed"]),
    ("deepseek_v3_no_q_lora", _config("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                           "truncate": False}),
     ["rope_parameters truncate false", "always rounds YaRN's correction range"]),
    ("deepseek_v3", _config("num_experts_per_tok", 3), ["num_experts_per_tok 3 / topk_group 1 != 2", "top-2"]),
    ("deepseek_v32", lambda hf: (_config("layer_types", ["indexed_attention", "full_attention"] * 2)(hf),
                                 _config("index_head_dim", 2)(hf)),
     ["layer_types ['full_attention', 'indexed_attention']: only indexed_attention",
      "index_head_dim 2 is smaller than qk_rope_head_dim 4"]),
    ("gpt_oss", _config("layer_types", ["sliding_attention", "chunked_attention"] * 2),
     ["layer_types", "cannot be expressed", "unknown: ['chunked_attention']"]),
    # every problem at once: a setting that cannot be expressed does not hide a wrong shape behind it
    ("mixtral", lambda hf: (_config("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})(hf),
                            _config("intermediate_size", 24)(hf)),
     ["rope type 'yarn' cannot be expressed", "has shape (16, 32), config.json implies (24, 32)"]),
], ids=["architecture", "glm-moe-dsa", "missing-tensor", "left-over-tensor", "shape-vs-config", "truncated", "missing-shard",
        "rope-type", "mla-yarn", "group-ranking", "v32-config", "gpt-oss-layer-types", "every-problem"])
def test_bad_input_is_one_message(converted, tmp_path, family, edit, must_name):
    proc = _edited(converted, tmp_path, family, edit)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("convert_hf.py: configuration error") == 1
    for text in must_name:
        assert text in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing partial left: no ckpt, no ckpt.partial


@pytest.mark.parametrize("family", SHARDS)
def test_export_gives_every_tensor_back_bit_for_bit(converted, family, tmp_path):
    """HF -> cp_ext -> HF: the same names, dtypes and bits, in shards with an index that transformers'
    from_pretrained loads with no missing or unexpected key."""
    hf, ckpt, _ = converted[family]
    check_export_bit_for_bit(TOOL, hf, ckpt, tmp_path / "exported", "40KB")


def test_export_refuses_a_non_empty_directory(converted, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    proc = run_script(0, TOOL, "export", "--load", converted["mixtral"][1], "--hf-dir", tmp_path / "taken", check=False)
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_trained_at_cp4_then_exported_scores_as_cp_ext_does(converted, tmp_path):
    """Fine-tune the import 3 steps at CP4 (the model flags from the checkpoint), export, load in transformers:
    its log-probs of a prompt equal cp_ext's on the trained checkpoint (and moved from the import's)."""
    import torch
    from transformers import AutoModelForCausalLM

    _, ckpt, original = converted["qwen3_moe"]
    trained, out, scores = tmp_path / "trained", tmp_path / "exported", tmp_path / "scores.jsonl"
    run_script(4, REPO_ROOT / "pretrain_moe.py", "--load", ckpt, "--use-checkpoint-args", "--finetune", "--save", trained,
               "--context-parallel-size", "4", "--seq-length", "64", "--global-batch-size", "4", "--train-iters", "3",
               "--lr", "1e-2", "--log-dir", tmp_path / "run")
    run_script(0, TOOL, "export", "--load", trained, "--hf-dir", out, "--hf-files", ckpt / "hf")
    run_script(1, GENERATE, "--load", trained, "--use-checkpoint-args", "--seq-length", "64", "--prompt", PROMPT,
               "--max-new-tokens", "1", "--logprobs", "--output", scores)
    record = json.loads(scores.read_text().splitlines()[0])
    ids = torch.tensor(record["prompt_ids"])[None]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.log_softmax(model(ids).logits.float()[0], -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        before = torch.log_softmax(original(ids).logits.float()[0], -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
    ours = torch.tensor(record["prompt_logprobs"][1:])
    assert (ours - theirs).abs().max() <= 1e-4, (ours - theirs).abs().max()
    assert (theirs - before).abs().max() > 1e-3, "training changed nothing the export carries"


def test_checkpoint_args_override_the_command_line_and_say_so(converted, tmp_path):
    """Megatron-LM's meaning: the checkpoint's model flags win; a model flag given too is named, once."""
    _, ckpt, _ = converted["mixtral"]
    proc = run_script(2, GENERATE, "--load", ckpt, "--use-checkpoint-args", "--hidden-size", "64", "--seq-length", "64",
                      "--context-parallel-size", "2", "--prompt", PROMPT, "--max-new-tokens", "1", "--logprobs",
                      "--output", tmp_path / "o.jsonl")
    said = proc.stdout + proc.stderr
    assert said.count("note: --use-checkpoint-args") == 1 and "hidden_size 64 -> 32" in said, said[-3000:]
    assert json.loads((tmp_path / "o.jsonl").read_text())["prompt_tokens"] == len(PROMPT)
