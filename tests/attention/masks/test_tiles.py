"""`cp_ext.attention.masks.tiles.plan_tile`: the blocks of a tile cover exactly the pairs the mask allows.

Single process, no kernels: for zigzag and contiguous shards of several sizes, every (q rank, k rank)
tile, causal and full, windows from 0 to beyond the sequence, one- and two-sided, with and without
documents, the union of the blocks' bands equals the true mask (causal, window, same document), no
pair is covered twice, and narrow bands are cut into strips that compute less than the rectangle.
"""

import itertools
import re

import pytest
import torch

from cp_ext.attention.masks.documents import document_runs
from cp_ext.attention.masks.tiles import make_window, plan_tile, position_runs
from cp_ext.token_partition import context_parallel_positions


def _truth(pq, pk, causal, window, dq, dk):
    i, j = pq[:, None], pk[None, :]
    m = torch.ones(len(pq), len(pk), dtype=torch.bool)
    if causal:
        m &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            m &= j >= i - left
        if right >= 0:
            m &= j <= i + right
    if dq is not None:
        m &= (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
    return m


def _covered(blocks, nq, nk, b):
    count = torch.zeros(nq, nk, dtype=torch.int64)
    for blk in blocks:
        if blk.b not in (None, b):
            continue
        m = torch.ones(blk.q1 - blk.q0, blk.k1 - blk.k0, dtype=torch.bool) if blk.band is None else \
            blk.band.mask(blk.q1 - blk.q0, blk.k1 - blk.k0, "cpu")
        count[blk.q0:blk.q1, blk.k0:blk.k1] += m.long()
    return count


WINDOWS = [None, (0, 0), (3, 0), (17, 0), (64, 0), (100, 0), (1000, 0), (5, 7), (0, 9), (-1, 4), (129, 70),
           (90, -1)]


@pytest.mark.quick
@pytest.mark.parametrize("layout, size, s", [("zigzag", 4, 128), ("contiguous", 4, 128), ("zigzag", 2, 1024)])
@pytest.mark.parametrize("docs", [False, True])
def test_blocks_cover_the_mask_exactly(layout, size, s, docs):
    ids = None
    if docs:
        ids = torch.zeros(1, s, dtype=torch.long)
        for cut in (s // 5, s // 3, s // 2 + 7):
            ids[:, cut:] += 1
        ids[:, s - 5:] = -1
    pos = [context_parallel_positions(s, ring_rank=r, ring_size=size, layout=layout) for r in range(size)]
    strips = 0
    for causal, window in itertools.product((True, False), WINDOWS):
        if causal and window is not None and window[1] > 0:
            continue  # refused by make_window (tested below)
        w = make_window(window, causal)
        for r, src in itertools.product(range(size), repeat=2):
            dq = ids[:, pos[r]] if docs else None
            dk = ids[:, pos[src]] if docs else None
            blocks = plan_tile(position_runs(pos[r].tolist()), position_runs(pos[src].tolist()), w,
                               same_tokens=r == src, q_docs=document_runs(dq) if docs else None,
                               k_docs=document_runs(dk) if docs else None)
            count = _covered(blocks, len(pos[r]), len(pos[src]), 0)
            want = _truth(pos[r], pos[src], causal, window, None if dq is None else dq[0], None if dk is None else dk[0])
            assert count.max() <= 1, (causal, window, r, src)  # no pair twice
            assert torch.equal(count.bool(), want), (causal, window, r, src)
            strips += sum(1 for blk in blocks if blk.band is not None and not blk.band.is_causal(
                blk.q1 - blk.q0, blk.k1 - blk.k0)) > 1
    if s >= 1024:
        assert strips > 0  # narrow bands on long tiles are cut into strips


@pytest.mark.quick
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window, causal", [((256, 0), True), ((100, 0), True), ((200, 150), False)])
def test_wide_windows_compute_their_pairs_in_native_squares(layout, window, causal):
    """A window of >= 64 computes exactly its pairs: mirrored causal squares, unmasked rectangles and
    causal squares (the kernels' own cases), and here none needs a mask."""
    s, size = 4096, 4
    pos = [context_parallel_positions(s, ring_rank=r, ring_size=size, layout=layout) for r in range(size)]
    w = make_window(window, causal)
    computed = needed = masked = 0
    for r, src in itertools.product(range(size), repeat=2):
        blocks = plan_tile(position_runs(pos[r].tolist()), position_runs(pos[src].tolist()), w, same_tokens=r == src)
        computed += sum(blk.pairs() for blk in blocks)
        needed += int(_truth(pos[r], pos[src], causal, window, None, None).sum())
        masked += sum(blk.band is not None and not (blk.band.is_causal(blk.q1 - blk.q0, blk.k1 - blk.k0) or
                                                    blk.band.is_anti_causal(blk.q1 - blk.q0, blk.k1 - blk.k0))
                      for blk in blocks)
    assert computed == needed, (computed, needed)
    assert masked == 0, masked  # the chunks and the window align: no block needs a mask


def test_strips_compute_less_than_the_rectangle():
    """A window of 1/16 of a zigzag chunk of 2048: its diagonal tile and its neighbour's corner."""
    w = make_window((128, 0), True)
    diagonal = plan_tile([(0, 2048, 0)], [(0, 2048, 0)], w, same_tokens=True)
    corner = plan_tile([(0, 2048, 2048)], [(0, 2048, 0)], w, same_tokens=False)
    area = lambda blocks: sum((b.q1 - b.q0) * (b.k1 - b.k0) for b in blocks)  # noqa: E731
    assert len(diagonal) > 1 and area(diagonal) < 0.2 * 2048 * 2048
    assert len(corner) == 1 and area(corner) <= 256 * 128  # one strip over the visible top-right corner


@pytest.mark.quick
def test_window_arguments_are_checked():
    with pytest.raises(ValueError, match="looks 4 tokens ahead"):
        make_window((8, 4), True)
    for bad in ((8,), (8, -2), ("a", 0), 8, (True, 0)):
        with pytest.raises(ValueError, match="window_size must be"):
            make_window(bad, False)
    assert make_window(None, False) is None and make_window((-1, -1), False) is None
    assert make_window((-1, -1), True).right == 0  # causal bounds an unbounded right side


@pytest.mark.quick
def test_bad_attention_arguments_name_the_argument():
    """One process, CP = 1 (`local_attention`): the argument and the limit are named, before any work."""
    from cp_ext.attention import local_attention
    from cp_ext.attention.kernels import supported

    q, k = torch.randn(8, 1, 4, 16), torch.randn(8, 1, 2, 16)
    cases = [
        (dict(v=torch.randn(8, 1, 2, 8), softmax_offset=torch.zeros(3)), "softmax_offset must be a float [h] = [4]"),
        (dict(v=torch.randn(8, 1, 2, 8), softmax_offset=torch.zeros(4, dtype=torch.long)), "softmax_offset must be"),
        (dict(v=torch.randn(6, 1, 2, 8)), "v may have its own head dim"),
        (dict(v=torch.randn(8, 1, 2, 8), window_size=(4, 2)), "looks 2 tokens ahead"),
        (dict(v=torch.randn(8, 1, 2, 8), window_size=(4, 0), kernel="flash"), "CUDA tensors only"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            local_attention(q, k, causal=True, **kwargs)
    # the limits, as data: a window on a kernel without masks, a padded v head dim over a kernel's limit
    assert "cannot apply a sliding window (--window-size)" in supported("flash", torch.bfloat16, 64, "cuda", window=True)
    assert supported("efficient", torch.bfloat16, 64, "cuda", window=True) is None
    assert "q/k 192 and v 128 run padded to 192" not in (supported("flash", torch.bfloat16, 192, "cuda",
                                                                   v_head_dim=128) or "")  # 192 <= 256: runs
    assert "at most 128" in supported("cudnn", torch.bfloat16, 192, "cuda", v_head_dim=128)
    assert supported("efficient", torch.float32, 192, "cuda", v_head_dim=128) is None  # its own v dim


def test_v_head_dim_of_its_own_on_every_cpu_kernel():
    """cpu pads v to q's head dim, unfused runs it natively: both equal explicit float64 attention."""
    from cp_ext.attention import local_attention
    from tests.attention.reference import explicit_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(24, 2, 4, 20, generator=g, dtype=torch.float64), torch.randn(24, 2, 2, 20, generator=g,
                                                                                    dtype=torch.float64)
    for dv in (12, 28):
        v = torch.randn(24, 2, 2, dv, generator=g, dtype=torch.float64)
        mask = torch.ones(24, 24, dtype=torch.bool).tril().expand(2, 24, 24)
        want = explicit_attention(q, k, v, None, mask, 20 ** -0.5)
        for kernel in ("cpu", "unfused"):
            got = local_attention(q, k, v, causal=True, kernel=kernel)
            assert got.shape == (24, 2, 4, dv) and (got - want).abs().max() < 1e-12, (kernel, dv)
