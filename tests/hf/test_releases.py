"""What real Hugging Face releases bring to tools/convert_hf.py, on the tiny models of `tests.hf.hf_models`:

* quantized weights, quantized here as the releases are: DeepSeek-V3's block-scaled FP8 (``weight_scale_inv``;
  8x8 blocks on the toy sizes, so edges and tiling matter) and GPT-OSS's MXFP4 experts (``_blocks``/``_scales``)
  (DeepSeek-V4's release: tests/hf/test_deepseek_v4.py, on its grids).
  The import's log-probs equal transformers' on the dequantized weights within 1e-4; the export writes them
  unquantized, without ``quantization_config``, and transformers loads it with no missing or unexpected key;
* the tokenizer: ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model CKPT/hf`` encodes as transformers'
  AutoTokenizer does, and the export carries it;
* imports at a grid under torchrun: every HF tensor is read by exactly one rank (each reads the units it
  holds, replicas by their main rank only), and the checkpoint is the single-process one bit for bit;
* a weights-only import resumes only as a fine-tune.
"""

import json

import pytest

from tests.launch import REPO_ROOT, run_script
from tests.hf.hf_models import save_quantized, tiny_hf
from tests.hf.test_convert import GENERATE, PROMPT, TOOL, _scores_equal_transformers


def _fp8_target(name):  # the release quantizes the layers' projections; norms, router, embeddings stay
    return ".layers." in name and name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


RELEASES = {"deepseek_v3_fp8": ("deepseek_v3", {}, "fp8", (8, 8), _fp8_target),
            # MXFP4 packs 32 values along the input dim: the experts' ffn 32 here (the tiny model's is 16)
            "gpt_oss_mxfp4": ("gpt_oss", {"intermediate_size": 32}, "mxfp4", None,
                              lambda name: name.endswith(("experts.gate_up_proj", "experts.down_proj")))}


@pytest.mark.parametrize("release", RELEASES)
def test_quantized_release_imports_dequantized(release, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    family, changes, method, block, target = RELEASES[release]
    hf, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    model, expected = save_quantized(tiny_hf(family, **changes), hf, target, method, block, family)
    assert any(k.endswith(("_scale_inv", "_blocks", ".scale")) for k in load_file(hf / "model.safetensors"))
    run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    _scores_equal_transformers(ckpt, model, 2, ["--context-parallel-size", "2"], tmp_path)
    proc = run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out)
    assert f"config.json's {method} quantization_config dropped" in proc.stdout
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(expected) and all(torch.equal(exported[k], t) for k, t in expected.items())
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


def _tokenizer(directory):
    """A byte-level BPE of the tiny vocabulary, saved as a release saves its tokenizer (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([PROMPT, "Long-context training starts from a released model."] * 3,
                            trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(directory)


def test_tokenizer_comes_from_the_hf_directory_and_goes_back(tmp_path):
    from transformers import AutoTokenizer

    model, hf, ckpt, out = tiny_hf("qwen3_moe"), tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    model.save_pretrained(hf)
    _tokenizer(hf)
    run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    scores = tmp_path / "scores.jsonl"
    run_script(1, GENERATE, "--config", ckpt / "model.yaml", "--load", ckpt, "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", ckpt / "hf", "--seq-length", "64", "--prompt", PROMPT, "--max-new-tokens", "2",
               "--logprobs", "--output", scores)
    record = json.loads(scores.read_text())
    theirs = AutoTokenizer.from_pretrained(hf)
    assert record["prompt_ids"] == theirs(PROMPT, add_special_tokens=False).input_ids
    assert len(record["prompt_ids"]) < len(PROMPT)  # merges, not bytes: the BPE is what encoded it
    run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out)
    assert AutoTokenizer.from_pretrained(out)(PROMPT).input_ids == theirs(PROMPT).input_ids


@pytest.mark.parametrize("family, grid", [("qwen3_moe", ["--pipeline-model-parallel-size", "2"]),
                                          ("deepseek_v3", ["--expert-model-parallel-size", "2"])])
def test_import_at_a_grid_reads_each_tensor_once(family, grid, tmp_path):
    """Under torchrun each rank writes (and so reads) only its own chunks: the pipeline stage's layers, the
    EP rank's experts, and of the replicated dense tensors only those it is the main replica of."""
    import torch
    from safetensors.torch import load_file

    model, hf, ckpt, out = tiny_hf(family), tmp_path / "hf", tmp_path / "ckpt", tmp_path / "exported"
    model.save_pretrained(hf)
    run_script(2, TOOL, "import", "--hf-dir", hf, "--save", ckpt, *grid)
    read = json.loads((ckpt / "iter_0000000" / "meta.json").read_text())["hf_tensors_read"]
    total = len(load_file(hf / "model.safetensors"))
    assert read["distinct"] == total == sum(read["per_rank"]) and max(read["per_rank"]) < total, read
    run_script(0, TOOL, "export", "--load", ckpt, "--hf-dir", out)
    exported = {}
    for path in out.glob("*.safetensors"):
        exported.update(load_file(path))
    original = load_file(hf / "model.safetensors")
    assert sorted(exported) == sorted(original) and all(torch.equal(exported[k], original[k]) for k in original)


def test_weights_only_import_resumes_only_as_a_finetune(tmp_path):
    hf, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    tiny_hf("mixtral").save_pretrained(hf)
    run_script(0, TOOL, "import", "--hf-dir", hf, "--save", ckpt)
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", "--config", ckpt / "model.yaml", "--load", ckpt,
                      "--train-iters", "1", "--seq-length", "64", check=False)
    assert proc.returncode == 2 and "holds weights only" in proc.stderr and "add --finetune" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_deepseek_mtp_layer_is_skipped_as_transformers_skips_it():
    """The release's MTP layer (model.layers.<num_hidden_layers>.*) has no place in DeepseekV3ForCausalLM."""
    from cp_ext.hf.deepseek_v3 import DeepseekV3

    config = tiny_hf("deepseek_v3").config.to_dict()
    assert config["num_hidden_layers"] == 4 and config["num_nextn_predict_layers"] == 1
    names = {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.3.input_layernorm.weight",
             "model.layers.40.input_layernorm.weight"}
    assert DeepseekV3(config).unused_by_design(names) == {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"}


def test_import_refuses_a_flag_that_is_not_a_grid_flag(tmp_path):
    proc = run_script(0, TOOL, "import", "--hf-dir", tmp_path / "none", "--save", tmp_path / "ckpt", "--lr", "1e-4",
                      check=False)
    assert proc.returncode == 2 and "--lr is not an import flag" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists()
