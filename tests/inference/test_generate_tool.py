"""tools/generate.py as a user runs it: a trained passkey checkpoint generates the same keys at CP=2
as at CP=1, text prompts come back as text and ids, and every bad input is one message, exit 2.

The passkey model is trained for a few iterations (a real run, saved), then generation runs under
torchrun at CP1 (1 rank) and CP2 ring (2 ranks) on the same held-out samples: the generated token
ids are identical (fp32). The accuracy in docs/performance.md comes from the full configs/cpu_passkey.yaml run.
"""

import json

import pytest

from tests.launch import REPO_ROOT, run_script as _run

TOOL = REPO_ROOT / "tools" / "generate.py"
TRAIN = ["--config", "configs/cpu_passkey.yaml", "--seq-length", "64", "--global-batch-size", "16",
         "--micro-batch-size", "8"]


@pytest.fixture(scope="module")
def passkey(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    _run(2, REPO_ROOT / "pretrain_moe.py", *TRAIN, "--context-parallel-size", "2", "--train-iters", "40",
         "--save", root / "ck", "--log-dir", root / "train")
    out = {}
    for cp in (1, 2):
        proc = _run(cp, TOOL, *TRAIN, "--context-parallel-size", cp, "--load", root / "ck", "--passkey-samples", 8,
                    "--output", root / f"cp{cp}.jsonl")
        out[cp] = ([json.loads(line) for line in (root / f"cp{cp}.jsonl").read_text().splitlines()], proc.stdout)
    return root, out


def test_passkey_generated_at_cp2_as_at_cp1(passkey):
    _, out = passkey
    one, two = out[1][0], out[2][0]
    assert len(one) == len(two) == 8 and all(len(r["ids"]) == 4 for r in one)
    assert [r["ids"] for r in one] == [r["ids"] for r in two]
    assert "keys generated right" in out[2][1] and "CP 2" in out[2][1]
    # the first line of the report is the same count at both sizes
    assert out[1][1].split("passkey: ")[1].split(" of")[0] == out[2][1].split("passkey: ")[1].split(" of")[0]


def test_text_prompt_gives_text_and_ids(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def main():"}\n\n{"text": "import os"}\n')
    proc = _run(2, TOOL, "--context-parallel-size", "2", "--prompt-jsonl", prompts, "--prompt", "x = 1",
                "--max-new-tokens", "3", "--output", tmp_path / "out.jsonl", "--logprobs")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["x = 1", "def main():", "import os"]
    assert all(len(r["ids"]) <= 3 and isinstance(r["text"], str) for r in records)
    for r in records:  # --logprobs: one per prompt token (null for the first) and per generated token, all <= 0
        assert len(r["prompt_logprobs"]) == r["prompt_tokens"] == len(r["prompt_ids"]) and r["prompt_logprobs"][0] is None
        assert len(r["logprobs"]) == len(r["ids"]) and all(x <= 0 for x in r["prompt_logprobs"][1:] + r["logprobs"])
    assert "no --load" in proc.stdout and "decoded one by one" in proc.stdout  # 5 and 11 tokens: tails at CP2


V4 = ["--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "12", "--v-head-dim", "16", "--qk-pos-emb-head-dim",
      "4", "--experimental-attention-variant", "dsv4_hybrid", "--csa-compress-ratios", "[0,4]", "--o-groups", "2",
      "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "2"]


def test_deepseek_v4_generates_at_cp2(tmp_path):
    """A DeepSeek-V4 model (a sliding and a CSA layer) generates at CP2 on its CP-sharded cache, with log-probs
    (exactness: tests/inference/test_generate_deepseek_v4.py, tests/hf/test_deepseek_v4.py)."""
    _run(2, TOOL, *V4, "--context-parallel-size", "2", "--prompt", "def main(): return 1", "--max-new-tokens", "6",
         "--output", tmp_path / "out.jsonl", "--logprobs")
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert len(record["ids"]) == 6 and len(record["logprobs"]) == 6 and all(x <= 0 for x in record["logprobs"])


@pytest.mark.quick
@pytest.mark.parametrize("args, must_name", [
    ([], "no prompt"),
    (["--prompt", ""], "an empty prompt"),
    (["--prompt", "abcdef", "--max-new-tokens", "8", "--max-position-embeddings", "10"],
     "exceeds --max-position-embeddings 10"),
    (["--passkey-samples", "4"], "--passkey-samples needs --synthetic-task passkey"),
    (["--prompt", "x", "--logprobs"], "--logprobs writes each prompt's log-probabilities into --output's JSON"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["--prompt", "x", "--top-p", "0"], "--top-p"),
    (["--prompt", "x", "--top-k", "5"], "add --temperature"),
    (["--prompt-jsonl", "{jsonl}"], "line 2: not JSON"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt"),
    (["--prompt", "x", "--hidden-size", "32", "--load", "{ckpt}"], "the checkpoint is of another model"),
], ids=["no-prompt", "empty-prompt", "too-long", "passkey-without-task", "logprobs-without-output", "temperature", "top-p", "top-k-greedy", "jsonl",
        "prompt-file", "other-model"])
def test_bad_input_is_one_message(tmp_path, args, must_name, crafted_checkpoint):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "ok"}\n{"prompt": \n')
    ckpt = crafted_checkpoint(tmp_path / "ckpt", 5)
    meta = ckpt / "iter_0000005" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "model": {"hidden_size": 64}}))
    args = [str(jsonl) if a == "{jsonl}" else str(ckpt) if a == "{ckpt}" else a for a in args]
    proc = _run(0, TOOL, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert must_name in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("generate.py: configuration error") == 1
