"""tools/convert_hf.py import and export, checked token by token against transformers' own model code.

Small random models are built with transformers' config classes (no hub): a Qwen3-MoE (q/k norms,
GQA with its own head dim, a dense first layer, normalized top-k routing), saved sharded with an
index, and a Mixtral (GQA, softmax top-2), saved as one file; their norms are perturbed so a
dropped norm shows. Each is imported, and `tools/generate.py --logprobs` scores a prompt at CP1,
CP2 ring, CP2 Ulysses, CP2 all_gather, CP4 = U2 x R2, TP2+SP, PP2 and EP2: every prompt token's and generated token's log-prob equals
transformers' log_softmax of its fp32 logits within 1e-4 (measured: 5e-7), and greedy tokens equal
transformers' argmax. Export gives every tensor back bit for bit, in shards transformers loads with
no missing or unexpected key, and after 3 training steps at CP4 the exported model's log-probs equal
cp_ext's. Bad inputs are one message naming the file, the tensor or the key.
"""

import json
import shutil
import struct

import pytest

from tests.launch import REPO_ROOT, run_script
from tests.tools.hf_models import SHARDS, tiny_hf

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


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("family", SHARDS)
def test_logprobs_equal_transformers(converted, family, grid, tmp_path):
    import torch

    hf, ckpt, model = converted[family]
    nproc, flags = GRIDS[grid]
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


def test_model_yaml_carries_the_families_flags(converted):
    text = (converted["qwen3_moe"][1] / "model.yaml").read_text()
    for line in ('qk-layernorm: true', 'moe-layer-freq: "[0,1,1,1]"', 'num-query-groups: "2"', 'kv-channels: "16"',
                 'padded-vocab-size: "384"', 'untie-embeddings-and-output-weights: true'):
        assert line in text, text
    assert "moe-router-pre-softmax" not in text  # norm_topk_prob: top-k, then softmax over the k


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
                                                           "original_max_position_embeddings": 32}),
     ["rope_parameters original_max_position_embeddings 32", "with original_max_position_embeddings 4096 only"]),
    ("deepseek_v3", _config("num_experts_per_tok", 3), ["num_experts_per_tok 3 / topk_group 1 != 2", "top-2"]),
], ids=["architecture", "missing-tensor", "left-over-tensor", "shape-vs-config", "truncated", "missing-shard",
        "rope-type", "mla-yarn", "group-ranking"])
def test_bad_input_is_one_message(converted, tmp_path, family, edit, must_name):
    proc = _edited(converted, tmp_path, family, edit)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("convert_hf.py: configuration error") == 1
    for text in must_name:
        assert text in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("family", SHARDS)
def test_export_gives_every_tensor_back_bit_for_bit(converted, family, tmp_path):
    """HF -> cp_ext -> HF: the same names, dtypes and bits, in shards with an index that transformers'
    from_pretrained loads with no missing or unexpected key."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf, ckpt, _ = converted[family]
    out = tmp_path / "exported"
    proc = run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out, "--max-shard-size", "40KB")
    assert "shard(s)" in proc.stdout
    original, exported = {}, {}
    for path in hf.glob("*.safetensors"):
        original.update(load_file(path))
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in original)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


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
