"""The passkey task's samples: the key and the answer sit on different CP ranks (CP = 2, both layouts)."""

import pytest
import torch

from cp_ext.data.passkey import DIGITS, KEY, QUERY, PasskeyDataset
from cp_ext.token_partition import context_parallel_positions


@pytest.mark.quick
def test_key_and_answer_on_different_cp_ranks():
    seq = 128
    data = PasskeyDataset(seq, num_samples=64, seed=3)
    owner = {}
    for layout in ("zigzag", "contiguous"):
        for rank in range(2):
            for p in context_parallel_positions(seq, ring_rank=rank, ring_size=2, layout=layout).tolist():
                owner[layout, p] = rank
    for i in range(len(data)):
        sample = data[i]
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        key_at = int((tokens == KEY).nonzero()[0])
        key = tokens[key_at + 1 : key_at + 5]
        answer_at = (mask > 0).nonzero().flatten()
        assert torch.equal(labels[answer_at], key) and tokens[answer_at[0]] == QUERY
        assert (key >= DIGITS).all() and data.vocab_size > int(tokens.max())
        assert torch.equal(sample["position_ids"], torch.arange(seq))
        for layout in ("zigzag", "contiguous"):
            key_ranks = {owner[layout, p] for p in range(key_at, key_at + 5)}
            answer_ranks = {owner[layout, int(p)] for p in answer_at}
            assert len(key_ranks) == 1 and key_ranks.isdisjoint(answer_ranks), (layout, key_at)


def test_cp2_run_recalls_the_key_across_shards(tmp_path):
    """configs/cpu_passkey.yaml as shipped (CP=2, 250 iterations, ~40 s): the answer loss ends
    well below ln 10, the best a model can do without attending from one CP shard to the other."""
    import json
    import math

    from tests.launch import REPO_ROOT, run_script

    run_script(2, REPO_ROOT / "pretrain_moe.py", "--config", REPO_ROOT / "configs" / "cpu_passkey.yaml", "--log-dir",
               tmp_path, timeout=900)
    losses = [json.loads(line)["train/lm_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 250 and losses[0] > 4.0
    final = sum(losses[-10:]) / 10
    assert final < math.log(10) - 0.4, f"answer loss {losses[0]:.3f} -> {final:.3f}; guessing gives {math.log(10):.3f}"
