"""DeepSeek-V4 in the planner (`cp_ext.perf.compressed_layers`, tools/plan_parallelism.py).

* the ``deepseek-v4-flash`` preset is what `ModelShape.from_args` reads from docs/families/deepseek_v4.md's command,
  284 B parameters (DeepSeek's published size; parameter counts of the built model per layer kind:
  tests/perf/test_model_shape.py);
* the rows each rank sends and receives (window halo, straddling blocks) and the entries it forms are what
  `cp_ext.attention.compressed.plan.SequencePlan` plans, on zigzag and contiguous layouts, shards shorter than the
  window or a block, CP2 to CP8 (the bytes themselves against torch.distributed: tests/bench/test_compressed_attention.py;
  the activations against tools/measure_memory.py: tests/bench/test_memory_measure_families.py);
* the planner lists layouts for a million tokens on H100 and H200 nodes with each layer kind's memory and bytes.
"""

import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from cp_ext.cli import plan_parallelism as plan_cli
from cp_ext.perf import compressed_layers as C
from cp_ext.perf.memory import PRESETS, ModelShape, mtp_layer_params, total_params
from cp_ext.perf.parallelism_planner import plan

ROOT = Path(__file__).resolve().parents[2]


def _documented_flash_flags():
    text = (ROOT / "docs" / "families" / "deepseek_v4.md").read_text()
    command = text[text.index("torchrun --nproc-per-node 8 pretrain_moe.py"):]
    command = command[:command.index("```")].replace("\\\n", " ")
    return shlex.split(command)[4:] + ["--vocab-size", "129280"]


def test_flash_preset_is_the_documented_command_and_its_published_size():
    from cp_ext.arguments import parse_args

    with mock.patch("cp_ext.platform.cuda_unusable_reason", lambda: None):
        args = parse_args(_documented_flash_flags(), world_size=8)
    shape = ModelShape.from_args(args)
    assert shape == PRESETS["deepseek-v4-flash"]
    kinds = [shape.compressed.kind(i) for i in range(shape.layers)]
    assert (kinds.count("sliding"), kinds.count("csa"), kinds.count("hca")) == (2, 21, 20)
    mtp = sum(mtp_layer_params(shape).values())
    assert round((total_params(shape) - mtp) / 1e9) == 284  # DeepSeek-V4-Flash: 284 B, and its MTP layer
    assert shape.mtp_layers == 1 and shape.compressed.kind(43) == "sliding"


@pytest.mark.parametrize("s, cp, layout, window, rate, overlap", [
    (1000, 2, "zigzag", 128, 128, False),     # chunks of 250: blocks straddle
    (1024, 4, "zigzag", 128, 4, True),        # chunks of 128
    (960, 8, "zigzag", 128, 128, False),      # chunks of 60: shorter than the window and the block
    (960, 8, "zigzag", 128, 4, True),
    (200, 4, "contiguous", 64, 8, True),      # shards of 50
    (96, 4, "zigzag", 16, 16, False),         # chunks of 12: blocks span three chunks
])
def test_rows_and_entries_are_what_the_attention_plans(s, cp, layout, window, rate, overlap):
    import torch

    from cp_ext.attention.compressed.plan import SequencePlan
    from cp_ext.token_partition import context_parallel_positions

    positions = [context_parallel_positions(s, ring_rank=r, ring_size=cp, layout=layout) for r in range(cp)]
    plan_ = SequencePlan.build(positions)
    segments = C._segments(s, cp, layout)
    for r in range(cp):  # the layout itself
        mine = torch.cat([torch.arange(a, b) for a, b, owner in segments if owner == r])
        assert torch.equal(mine, positions[r])

    def moved(needs):
        sent = [sum(int((plan_.owner[needs[p]] == r).sum()) for p in range(cp) if p != r) for r in range(cp)]
        return sent, [needs[r].numel() for r in range(cp)]

    halo = moved([plan_.window_needs(r, window) for r in range(cp)])
    assert C._rows_moved(segments, [[(max(0, a - window + 1), a) for a, _, o in segments if o == p]
                                    for p in range(cp)]) == halo
    span = 2 * rate if overlap else rate
    pools = [[(max(0, first * rate - span + rate), end * rate) for first, end in C._entries_on(segments, p, rate)
              if end > first] for p in range(cp)]
    assert C._rows_moved(segments, pools) == moved([plan_.pool_needs(r, rate, overlap) for r in range(cp)])
    assert [sum(e - f for f, e in C._entries_on(segments, r, rate)) for r in range(cp)] == [
        plan_.owned_entries(r, rate).numel() for r in range(cp)]
    assert sum(halo[0]) > 0


def test_layer_bytes_by_hand_at_cp2():
    """Zigzag CP2, 1024 tokens, bf16: the halo 127 rows of 512 (2 B) and the positions (int64) forward; HCA adds the
    entries all-gathered (4 of 128 tokens per rank, bf16) and all-reduced back."""
    c = C.CompressedLayers(ratios=(0, 4, 128))
    sliding = C.compressed_layer_bytes(c, "sliding", s=1024, cp=2, d=512)
    assert sliding == [{"fwd": 512 * 8 + 127 * 512 * 2, "bwd": 127 * 512 * 2}] * 2
    hca = C.compressed_layer_bytes(c, "hca", s=1024, cp=2, d=512)
    assert hca[0] == {"fwd": sliding[0]["fwd"] + 4 * 512 * 2, "bwd": sliding[0]["bwd"] + 8 * 512 * 2}
    assert C.compressed_layer_bytes(c, "csa", s=1024, cp=1, d=512) == [{"fwd": 0, "bwd": 0}]


def test_output_groups_bound_tensor_parallelism():
    m = PRESETS["deepseek-v4-flash"]
    plans = plan(m, s=131072, global_batch=8, gpu_memory=80 * 2 ** 30, gpus_per_node=16, nodes=1)
    tp16 = [p for p in plans if p.grid.tp == 16]
    assert tp16 and all(not p.valid and "--o-groups" in p.reason for p in tp16)
    assert all(p.grid.ulysses == 1 for p in plans if p.valid)  # V4's layers exchange rows, not heads


def test_a_million_tokens_planned_on_h100_and_h200_nodes(capsys):
    """16 nodes of H100s (80 GiB) fit Flash with its MTP layer at 1,048,576 tokens (with full recompute), 16 of H200s
    (141 GiB) in more layouts; 8 H100 nodes do not. The table gives each kind's layers, attention parameters,
    activations and bytes."""
    common = ["--model", "deepseek-v4-flash", "--seq-length", "1048576", "--global-batch", "16", "--top", "3"]
    assert plan_cli.main(common + ["--nodes", "16"]) == 0
    out = capsys.readouterr().out
    assert " B params" in out and "2 sliding, 21 CSA (1/4, top-512), 20 HCA (1/128) layers" in out
    assert "fits:" in out and "needs full recompute" in out
    table = out[out.index("DeepSeek-V4's layer kinds on"):].splitlines()[2:5]
    assert [row.split()[:2] for row in table] == [["sliding", "2"], ["csa", "21"], ["hca", "20"]]
    ratios = {row.split()[0]: float(row.split()[-1]) for row in table}
    assert ratios["sliding"] < ratios["hca"] < ratios["csa"] < 1  # every kind sends less than a dense K/V exchange
    fitting = lambda text: int(re.search(r"^(\d+) of \d+ layouts", text, re.M).group(1))  # noqa: E731
    h100 = fitting(out)
    assert plan_cli.main(common + ["--nodes", "8"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert plan_cli.main(common + ["--nodes", "16", "--gpu-memory-gib", "141"]) == 0
    assert fitting(capsys.readouterr().out) > h100

