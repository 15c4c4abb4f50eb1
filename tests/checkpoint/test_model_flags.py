"""The model a run builds against the checkpoint it loads: --use-checkpoint-args restores what shapes a
tensor, and a model that differs anyway is called a mismatch, never a corrupt checkpoint.

A checkpoint of a model with learned absolute positions, trained at --seq-length 64, is loaded by
`tools/generate.py` and `pretrain_moe.py` with and without the flags that size its position table
(the default --seq-length is 128).
"""

import pytest

from tests.launch import REPO_ROOT, run_script

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "2",
         "--position-embedding-type", "learned_absolute", "--seed", "4"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned_positions")
    run_script(0, REPO_ROOT / "pretrain_moe.py", *MODEL, "--seq-length", "64", "--global-batch-size", "2",
               "--train-iters", "2", "--save", root / "ck", "--log-dir", root / "run", timeout=300)
    return root / "ck"


def test_generate_with_checkpoint_args_builds_the_saved_position_table(checkpoint):
    """The reported failure: generate.py --use-checkpoint-args without --seq-length built a 128-row table."""
    proc = run_script(0, REPO_ROOT / "tools" / "generate.py", "--load", checkpoint, "--use-checkpoint-args",
                      "--prompt", "hello", "--max-new-tokens", "4", timeout=300)
    assert "generated (4 tokens)" in proc.stdout, proc.stdout[-2000:]
    # past the saved table's 64 rows: one message before anything is built
    proc = run_script(0, REPO_ROOT / "tools" / "generate.py", "--load", checkpoint, "--use-checkpoint-args",
                      "--prompt", "x" * 70, "--max-new-tokens", "4", check=False, timeout=300)
    assert proc.returncode == 2 and "exceeds --max-position-embeddings 64" in proc.stderr, proc.stderr[-2000:]


def test_a_given_seq_length_wins_over_the_checkpoints(checkpoint, tmp_path):
    """Megatron-LM's rule: --seq-length and --max-position-embeddings come from the checkpoint only where
    the run gives none. A shorter --seq-length trains on the saved 64-row table."""
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", "--load", checkpoint, "--use-checkpoint-args", "--finetune",
                      "--seq-length", "32", "--global-batch-size", "2", "--train-iters", "1", "--log-dir", tmp_path,
                      timeout=300)
    assert "loaded the weights of iteration 2" in proc.stdout, proc.stdout[-2000:]
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", "--load", checkpoint, "--use-checkpoint-args", "--finetune",
                      "--seq-length", "128", "--train-iters", "1", "--log-dir", tmp_path, check=False, timeout=300)
    assert proc.returncode == 2 and "--seq-length 128 exceeds --max-position-embeddings 64" in proc.stderr, proc.stderr


def test_another_model_is_a_mismatch_naming_tensor_shapes_and_flag(checkpoint, tmp_path):
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", *MODEL, "--load", checkpoint, "--finetune",
                      "--train-iters", "1", "--log-dir", tmp_path, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("pretrain_moe.py: configuration error") == 1 and "Traceback" not in proc.stderr
    assert "holds another model than this run builds" in proc.stderr, proc.stderr
    assert "embedding.position_embeddings.weight: [64, 32] in the checkpoint, [128, 32] here" in proc.stderr
    assert "--max-position-embeddings" in proc.stderr
    for misleading in ("corrupt", "truncated", "--ckpt-fallback"):
        assert misleading not in proc.stderr
