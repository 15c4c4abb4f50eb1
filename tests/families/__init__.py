"""Megatron-LM's MoE scripts as the suite runs them: their model arguments, copied unchanged
(``*.args``), shrunk only in sizes.

`script_args` reads a copy as the script passes it. `tiny` keeps every flag and its meaning and
changes only sizes (layers, hidden, heads, experts, ranks, sequence length, window) so that a
CPU runs it in seconds, and supplies what a launcher adds around the model arguments: the data
(the embedded corpus, byte-tokenized, instead of the scripts' tokenizer and paths) and the grid.
Post-training (modelopt) flags in the copies are dropped here: pretrain_moe.py refuses them by
name (tests/arguments/test_model.py), because they configure export, not training.
"""

import shlex
from pathlib import Path

HERE = Path(__file__).parent
FAMILIES = ("mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v2_lite", "deepseek_r1", "gpt_oss_20b")
# The linear-attention hybrids: their grids (state passing on the ring, not Ulysses) are
# tests/training/test_linear_attention_training.py's; the memory planner does not model them yet.
LINEAR_FAMILIES = ("qwen3_5_397b_a17b",)

# Sizes only: the same flags at toy values (4 layers, hidden 32, 4 heads, 4 experts).
TINY_SIZES = {
    "--num-layers": "4", "--hidden-size": "32", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "8", "--num-experts": "4", "--moe-ffn-hidden-size": "16",
    "--moe-router-topk": "2", "--moe-shared-expert-intermediate-size": "24", "--moe-router-num-groups": "2",
    "--moe-router-group-topk": "1", "--q-lora-rank": "12", "--kv-lora-rank": "16", "--qk-head-dim": "8",
    "--qk-pos-emb-head-dim": "4", "--v-head-dim": "8", "--seq-length": "64", "--max-position-embeddings": "64",
    "--window-size": "6,0", "--make-vocab-size-divisible-by": "128", "--padded-vocab-size": "512",
    "--micro-batch-size": "1", "--global-batch-size": "2", "--linear-key-head-dim": "8", "--linear-value-head-dim": "8",
    "--linear-num-key-heads": "2", "--linear-num-value-heads": "4",
    # dense-first layers, as many as the 4 layers allow: DeepSeek-V2-Lite 1 of 27, DeepSeek-R1 3 of 61
    "--moe-layer-freq": None,
}
DENSE_FIRST = {"deepseek_v2_lite": "([0]+[1]*3)", "deepseek_r1": "[0]*1+[1]*3"}
# What a launcher supplies and the suite replaces: data and tokenizer, checkpoints and schedule.
LAUNCHER_FLAGS = {"--tokenizer-type": 1, "--tokenizer-model": 1, "--data-path": 1, "--split": 1, "--save": 1,
                  "--load": 1, "--save-interval": 1, "--train-iters": 1, "--lr-decay-iters": 1,
                  "--lr-warmup-iters": 1, "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                  "--expert-model-parallel-size": 1}
MODELOPT_PREFIX = "--export-"
# DeepEP's dispatcher needs CUDA and deep_ep (refused on CPU, naming alltoall): alltoall routes the same
CPU_DISPATCHER = {"flex": "alltoall"}


def script_args(family):
    """The copy's flags, as tokens, exactly as the script passes them."""
    lines = [line for line in (HERE / f"{family}.args").read_text().splitlines() if not line.startswith("#")]
    return shlex.split(" ".join(lines))


def _flags(tokens):
    """[(flag, [values])] in order."""
    out = []
    for token in tokens:
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


def tiny(family, *extra):
    """The script's flags at toy sizes, with the suite's data and schedule, and `extra` after them."""
    tokens = []
    for flag, values in _flags(script_args(family)):
        if flag.startswith(MODELOPT_PREFIX) or flag in LAUNCHER_FLAGS:
            continue
        if flag == "--moe-layer-freq":
            values = [DENSE_FIRST[family]]
        elif flag in TINY_SIZES:
            values = [TINY_SIZES[flag]]
        elif flag == "--moe-token-dispatcher-type":
            values = [CPU_DISPATCHER.get(values[0], values[0])]
        tokens += [flag, *values]
    tokens += ["--train-iters", "3", "--lr-warmup-iters", "1", "--seq-length", "64", "--global-batch-size", "2"]
    return tokens + list(extra)
