"""Every bad input a careless or hostile user would try, run as the user runs it.

Each row starts the real `pretrain_moe.py` (plain ``python``, one rank) and must end within
30 s with exit status 2, one ``configuration error`` message naming the flag or file and
the fix, and no Python traceback. A few rows go through torchrun with 2 ranks: the message
is printed once, by rank 0. docs/operations.md says what a bad input meets.
"""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.launch import REPO_ROOT, run_script



def _tokenizer_without_eod(root):
    """A HuggingFace tokenizer.json whose vocabulary names no EOD token, and a corpus preprocessed with it."""
    from tokenizers import Tokenizer, models

    from cp_ext.data.indexed import write_indexed_dataset

    root.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>")).save(str(root / "tokenizer.json"))
    write_indexed_dataset(str(root / "corpus_text_document"), [np.array([1, 2, 1]), np.array([2, 2])], 3)
    return root


# id: (argv, YAML text or None, texts the message must hold)
CASES = {
    # YAML values are typed by the flags' own parser
    "yaml-bool-as-string": ([], 'bf16: "false"', ["bf16", "not a boolean"]),
    "yaml-device-gpu": ([], "device: gpu", ["device", "invalid choice: 'gpu'", "'cuda'"]),
    "yaml-choice-case": ([], "cp-load-balance: Zigzag", ["cp-load-balance", "'Zigzag'", "'zigzag'"]),
    "yaml-list-for-int": ([], "seq-length: [128]", ["seq-length", "takes one value"]),
    "yaml-string-data-path": ([], "data-path: /nonexistent/prefix", ["/nonexistent/prefix.bin"]),
    "yaml-unknown-key": ([], "num-layer: 4", ["unknown key 'num-layer'"]),
    "yaml-not-a-mapping": ([], "- 1\n- 2", ["expected a mapping"]),
    "yaml-null-value": ([], "lr:", ["lr", "give a value"]),
    "config-missing": (["--config", "/nonexistent/run.yaml"], None, ["/nonexistent/run.yaml", "cannot read"]),
    # sizes and counts: >= 1 where 0 would fall back to a default or divide by zero
    "ffn-hidden-size-0": (["--ffn-hidden-size", "0"], None, ["--ffn-hidden-size", ">= 1", "got 0"]),
    "moe-ffn-hidden-size-0": (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], None, ["--moe-ffn-hidden-size"]),
    "lr-decay-iters-0": (["--lr-decay-iters", "0"], None, ["--lr-decay-iters", ">= 1"]),
    "exit-interval-negative": (["--exit-interval", "-1"], None, ["--exit-interval", "got -1"]),
    "heads-0": (["--num-attention-heads", "0"], None, ["--num-attention-heads", ">= 1"]),
    "hidden-0": (["--hidden-size", "0"], None, ["--hidden-size", ">= 1"]),
    "hidden-negative": (["--hidden-size", "-64"], None, ["--hidden-size", "got -64"]),
    "kv-channels-0": (["--kv-channels", "0"], None, ["--kv-channels", ">= 1"]),
    "topk-0": (["--num-experts", "4", "--moe-router-topk", "0"], None, ["--moe-router-topk", ">= 1"]),
    "global-batch-0": (["--global-batch-size", "0"], None, ["--global-batch-size", "got 0"]),
    "global-batch-negative": (["--global-batch-size", "-2"], None, ["--global-batch-size", "got -2"]),
    "train-iters-0": (["--train-iters", "0"], None, ["--train-iters", ">= 1"]),
    "vocab-divisible-0": (["--make-vocab-size-divisible-by", "0"], None, ["--make-vocab-size-divisible-by"]),
    "timeout-0": (["--distributed-timeout-minutes", "0"], None, ["--distributed-timeout-minutes", ">= 1"]),
    "seq-length-text": (["--seq-length", "abc"], None, ["--seq-length", "'abc' is not an integer"]),
    "seq-length-float": (["--seq-length", "1.5"], None, ["--seq-length", "'1.5' is not an integer"]),
    # rates and probabilities: finite and in range
    "lr-nan": (["--lr", "nan"], None, ["--lr", "got nan"]),
    "lr-inf": (["--lr", "inf"], None, ["--lr", "got inf"]),
    "adam-beta2-above-1": (["--adam-beta2", "1.5"], None, ["--adam-beta2", "< 1"]),
    "dropout-above-1": (["--hidden-dropout", "1.5"], None, ["--hidden-dropout", "< 1"]),
    "adam-eps-0": (["--adam-eps", "0"], None, ["--adam-eps", "> 0"]),
    # data
    "split-no-train": (["--split", "0,100,0"], None, ["--split 0,100,0", "train's > 0"]),
    "split-text": (["--split", "abc"], None, ["--split abc", "e.g. 969,30,1"]),
    "split-inf": (["--split", "inf,1,1"], None, ["--split inf,1,1"]),
    "data-path-inf-weight": (["--data-path", "inf", "P1", "1", "P2"], None, ["--data-path inf P1 1 P2", "finite"]),
    # packed documents (Megatron's --reset-position-ids, --reset-attention-mask, --eod-mask-loss) need EOD tokens
    "document-flags-with-passkey": (["--synthetic-task", "passkey", "--reset-position-ids", "--reset-attention-mask"],
                                    None, ["--reset-position-ids --reset-attention-mask", "--synthetic-task passkey",
                                           "no EOD token", "drop them"]),
    "document-flag-tokenizer-without-eod": (
        ["--eod-mask-loss", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
         "{no_eod}/tokenizer.json", "--data-path", "{no_eod}/corpus_text_document"], None,
        ["--eod-mask-loss", "--tokenizer-type HuggingFaceTokenizer --tokenizer-model", "has none", "drop the flag"]),
    # per-layer --cp-comm-type: the layers share one sequence layout
    "cp-comm-type-mixes-layouts": (["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--cp-comm-type", "p2p", "a2a"], None,
                                   ["--cp-comm-type mixes a2a and p2p", "all_gather with one other type"]),
    "cp-comm-type-list-length": (["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--cp-comm-type", "p2p", "all_gather"], None,
                                 ["--cp-comm-type lists 2 types", "--num-layers 4"]),
    # router: megatron's rules said before anything is built
    "top1-without-pre-softmax": (["--num-experts", "4", "--moe-router-topk", "1"], None, ["--moe-router-pre-softmax"]),
    "expert-bias-with-softmax": (["--num-experts", "4", "--moe-router-enable-expert-bias"], None,
                                 ["--moe-router-score-function sigmoid"]),
    "router-flag-on-dense-model": (["--moe-z-loss-coeff", "1e-3"], None, ["--moe-z-loss-coeff needs --num-experts"]),
    "z-loss-coeff-0": (["--num-experts", "4", "--moe-z-loss-coeff", "0"], None, ["--moe-z-loss-coeff", "> 0"]),
    "group-topk-alone": (["--num-experts", "4", "--moe-router-group-topk", "1"], None, ["--moe-router-num-groups"]),
    # flags that do not exist, and devices that are not there
    "unknown-flag": (["--num-layer", "4"], None, ["unrecognized arguments: --num-layer"]),
    "device-cuda-without-cuda": (["--device", "cuda"], None, ["--device cuda", "--device cpu"]),
    # found once the tokenizer's vocabulary is known (the embedded corpus: 257 bytes)
    "padded-vocab-below-vocab": (["--padded-vocab-size", "128"], None,
                                 ["--padded-vocab-size 128 is below the vocabulary's 257 tokens"]),
    # a checkpoint the run cannot continue
    "train-iters-below-checkpoint": (["--train-iters", "3", "--load", "{ckpt}"], None,
                                     ["--train-iters 3 is below the checkpoint's iteration 5", "--finetune"]),
    # under SLURM (the environment below): a requeued job would start over; one torchrun per node of the step
    "slurm-requeued-without-save": ([], None, ["SLURM_RESTART_COUNT=1", "--save DIR", "--no-requeue"]),
    "slurm-requeued-without-load": (["--save", "{ckpt}"], None, ["SLURM_RESTART_COUNT=1", "has --save but no --load",
                                                                 "--no-requeue"]),
    "slurm-step-nodes-vs-torchrun": ([], None, ["runs on 2 nodes (n[1-2]; SLURM_STEP_NUM_NODES)",
                                                "torchrun sees 1 (GROUP_WORLD_SIZE)", "--nnodes 2"]),
    "exit-duration-0": (["--exit-duration-in-mins", "0"], None, ["--exit-duration-in-mins", "> 0"]),
}
CASE_ENV = {"slurm-requeued-without-save": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"},
            "slurm-requeued-without-load": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"},
            "slurm-step-nodes-vs-torchrun": {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_NODES": "2",
                                             "SLURM_STEP_NODELIST": "n[1-2]", "GROUP_WORLD_SIZE": "1"}}


def _run(cmd, tmp_path, yaml_text=None, env=None):
    if yaml_text is not None:
        config = tmp_path / "run.yaml"
        config.write_text(yaml_text)
        cmd = cmd + ["--config", str(config)]
    run_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run_env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=run_env, timeout=120)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, crafted_checkpoint):
    """All rows, two at a time, each ``python pretrain_moe.py ...`` in a process of its own (forked
    from the pre-imported server: `run_script`; the version check below starts a real interpreter)."""
    def one(case):
        argv, yaml_text, _ = CASES[case]
        tmp = tmp_path_factory.mktemp(case)
        argv = [a.replace("{ckpt}", str(crafted_checkpoint(tmp / "ckpt", 5))) for a in argv]
        if any("{no_eod}" in a for a in argv):
            argv = [a.replace("{no_eod}", str(_tokenizer_without_eod(tmp / "no_eod"))) for a in argv]
        if yaml_text is not None:
            (tmp / "run.yaml").write_text(yaml_text)
            argv += ["--config", str(tmp / "run.yaml")]
        return case, run_script(0, REPO_ROOT / "pretrain_moe.py", *argv, check=False, timeout=120, cwd=tmp,
                                env=CASE_ENV.get(case))

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, CASES))


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_one_clear_message(outcomes, case):
    proc, must_name = outcomes[case], CASES[case][2]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("pretrain_moe.py: configuration error") == 1, proc.stderr
    for text in must_name:
        assert text in proc.stderr, f"{text!r} missing from:\n{proc.stderr}"
    assert "iteration" not in proc.stdout  # refused before any training (a hang fails run_script's timeout)


@pytest.mark.parametrize("case", ["heads-0", "yaml-device-gpu", "train-iters-below-checkpoint"])
def test_torchrun_prints_the_message_once(tmp_path, case, crafted_checkpoint):
    argv, yaml_text, must_name = CASES[case]
    argv = [a.replace("{ckpt}", str(crafted_checkpoint(tmp_path / "ckpt", 5))) for a in argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "pretrain_moe.py"), *argv]
    proc = _run(cmd, tmp_path, yaml_text)  # a rank left waiting would hang past _run's timeout and fail
    assert proc.returncode != 0 and "iteration" not in proc.stdout
    assert proc.stderr.count("pretrain_moe.py: configuration error") == 1, proc.stderr
    assert must_name[0] in proc.stderr and "[rank0]: Traceback" not in proc.stderr


@pytest.mark.parametrize("version", ["0.15.0", "0.20.0"])
def test_unsupported_megatron_core_is_refused(tmp_path, version):
    """A megatron-core outside the supported range (shadowed here by a dist-info of another version) is one
    message naming both ends of the range, the installed version and the fix; the override lets one try it."""
    fake = tmp_path / "site" / f"megatron_core-{version}.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO_ROOT)])}
    proc = _run([sys.executable, str(REPO_ROOT / "pretrain_moe.py")], tmp_path, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("pretrain_moe.py:") == 1, proc.stderr
    assert f"supports megatron-core 0.16.1 through 0.19.x, but {version} is installed" in proc.stderr
    assert "pip install 'megatron-core>=0.16.1,<0.20'" in proc.stderr
    proc = _run([sys.executable, str(REPO_ROOT / "pretrain_moe.py"), "--help"], tmp_path,
                   env={**env, "CP_EXT_ALLOW_MEGATRON_CORE": version})
    assert proc.returncode == 0, proc.stderr  # the documented way to try another version
