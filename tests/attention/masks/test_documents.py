"""Packed documents: every CP attention variant with ``document_ids`` against float64 truth.

Worker (`python -m torch.distributed.run --nproc-per-node=4 tests/attention/masks/test_documents.py
--results-dir DIR`): every rank builds the same seeded full q, k, v, dout and document ids
(random lengths; a document spanning every rank; single-token documents; documents shorter
than a chunk; tail padding with its own id and with a negative id, whose rows attend to
nothing), computes the float64 truth and the single-device fp32 SDPA error *with the same
block-diagonal (causal) mask* (padding rows: output and gradients 0), then runs the variant
on its shard and records the max abs error of out, dq, dk and dv.

Bounds (per tensor, max over ranks; `tests.attention.reference.check_bounds`, derived there):
RMS error <= 1.5 x the single-device fp32 RMS error (SDPA's flash kernel with the same mask, see
`reference`), max error <= 2 x the single-device fp32 error + one fp32 ulp of max|truth| +
(T - 1) merges x u x G (T = the partial results a row merges: R ring steps, 1 for Ulysses, 2C key
runs for all-gather); fp64 <= 1e-12, which checks the masking and merging algebra exactly.
Also: padding rows give exactly 0 and nothing is NaN; a ring step whose tile shares no
document computes nothing, and a ring with no work left stops (bytes counted).
"""

import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.reference import (  # noqa: E402
    check_bounds, error_stats, in_order, merge_sensitivity, reference_orders, summation_order_perms,
)
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
S = 64  # 8 zigzag chunks of 8 at C = 4

# Per sample: document lengths (a negative length: that many padding tokens with id -1).
DISTRIBUTIONS = {
    "random": None,  # seeded random lengths 1..21
    "spanning": [[1, 1, 60, 2], [3, 61]],  # one document over every rank
    "singletons": [[1] * 64, [1] * 30 + [34]],
    "short": [[3, 5, 2, 7, 1, 4, 6, 2, 9, 3, 5, 1, 8, 2, 6], [2] * 32],  # shorter than a chunk
    "pad_negative": [[10, 20, 14, -20], [30, 30, -4]],  # padding attends to nothing
    "pad_own_id": [[10, 20, 14, 20], [5, 50, 9]],  # padding as one more document
    "none": [[64], [64]],  # document_ids=None (all_gather only: the other variants have their own tests)
}


def _lengths(name, seed):
    import random

    if DISTRIBUTIONS[name] is not None:
        return DISTRIBUTIONS[name]
    rng, samples = random.Random(seed), []
    for _ in range(2):
        lengths, left = [], S
        while left:
            n = min(left, rng.choice([1, 2, 3, 5, 8, 13, 21]))
            lengths.append(n)
            left -= n
        samples.append(lengths)
    return samples


def full_document_ids(name, seed=0):
    import torch

    rows = []
    for lengths in _lengths(name, seed):
        row, doc = [], 0
        for n in lengths:
            row += [-1] * -n if n < 0 else [doc] * n
            doc += n > 0
        assert len(row) == S, (name, len(row))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


VARIANTS = ("ring2", "ring4", "ring4_contiguous", "ulysses2", "ulysses4", "hybrid_u2r2", "all_gather2", "all_gather4", "all_gather_u2r2",
            "doc_zigzag2", "doc_zigzag4", "all_gather_doc_zigzag4")
# Dynamic CP's layout (`cp_ext.token_partition.DocumentZigzag`): each of these documents zigzagged over the group on its
# own. The masks follow the ids whatever they are, so every distribution runs on it (causal: what dynamic CP trains).
DOC_ZIGZAG = {2: (4, 12, 20, 28), 4: (8, 24, 16, 16)}


def _cases():
    cases = []
    for variant in VARIANTS:
        for dist_name in DISTRIBUTIONS:
            if dist_name == "none" and not variant.startswith("all_gather"):
                continue
            if "doc_zigzag" in variant and (dist_name in ("none", "singletons", "short")):
                continue
            for causal in (True, False):
                for gqa in (False, True):
                    if not causal and (dist_name not in ("random", "pad_negative", "none") or "doc_zigzag" in variant):
                        continue  # full attention: two distributions are enough
                    cases.append(dict(variant=variant, docs=dist_name, causal=causal, gqa=gqa, dtype="fp32"))
    cases += [dict(variant=v, docs="random", causal=True, gqa=True, dtype="fp64") for v in ("ring4", "ring4_contiguous", "ulysses4", "hybrid_u2r2", "all_gather4", "all_gather_u2r2")]
    for c in cases:
        c["name"] = f"{c['variant']}-{c['docs']}-{'causal' if c['causal'] else 'full'}-{'gqa' if c['gqa'] else 'mha'}-{c['dtype']}"
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------- worker
def reference(q, k, v, dout, ids, causal, dtype):
    """Attention in ``dtype`` on one device with the block-diagonal (causal) mask: SDPA on each
    document of each sample, as a single-device packed-sequence run computes it (flash-attn's
    varlen call, or SDPA with the mask). Padding rows (negative ids) get output and gradients 0.

    Below fp64 each call is SDPA's flash backend, the kernel family the CP variants call on CPU.
    (SDPA with a boolean mask over the whole sample runs its math backend, whose backward is up
    to 2x more accurate at these sizes: it would measure the kernel, not the CP algorithm.)
    """
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = lambda: contextlib.nullcontext() if dtype == torch.float64 else sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    outs, grads = torch.zeros_like(q, dtype=torch.float64), [torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
    group = q.shape[2] // k.shape[2]  # GQA: KV heads repeated for the call, gradients summed back
    for b in range(q.shape[1]):
        values, counts = torch.unique_consecutive(ids[b], return_counts=True)
        start = 0
        for value, n in zip(values.tolist(), counts.tolist()):
            rows, start = slice(start, start + n), start + n
            if value < 0:
                continue
            xs = [x[rows, b].to(dtype).transpose(0, 1).unsqueeze(0).detach().requires_grad_() for x in (q, k, v)]
            with backend():
                o = F.scaled_dot_product_attention(xs[0], xs[1].repeat_interleave(group, dim=1),
                                                   xs[2].repeat_interleave(group, dim=1), is_causal=causal)
            o.backward(dout[rows, b].to(dtype).transpose(0, 1).unsqueeze(0))
            outs[rows, b] = o.detach()[0].transpose(0, 1).double()
            for g, x in zip(grads, xs):
                g[rows, b] = x.grad[0].transpose(0, 1).double()
    return [outs] + grads


def _positions(variant, rank):
    from cp_ext.token_partition import DocumentZigzag, context_parallel_positions

    if "doc_zigzag" in variant:
        size = int(variant[-1])
        return DocumentZigzag(DOC_ZIGZAG[size], size).positions(rank % size)
    if variant in ("hybrid_u2r2", "all_gather_u2r2"):  # Ulysses [0, 1] [2, 3], rings [0, 2] [1, 3]
        return context_parallel_positions(S, ring_rank=rank // 2, ring_size=2, ulysses_rank=rank % 2, ulysses_size=2)
    if variant == "ring4_contiguous":
        return context_parallel_positions(S, ring_rank=rank, ring_size=4, layout="contiguous")
    size = int(variant[-1])
    if variant.startswith("ulysses"):
        return context_parallel_positions(S, ring_rank=0, ring_size=1, ulysses_rank=rank % size, ulysses_size=size)
    return context_parallel_positions(S, ring_rank=rank % size, ring_size=size)


def _attn(case, groups, rank, ids_local, positions):
    from cp_ext.attention import all_gather_attention, hybrid_attention, ring_attention, ulysses_attention
    from cp_ext.token_partition import DocumentZigzag

    v, kw = case["variant"], dict(causal=case["causal"], document_ids=None if case["docs"] == "none" else ids_local)
    if v == "ring4_contiguous":
        return lambda q, k, v_: ring_attention(q, k, v_, group=groups[4], layout="contiguous", **kw)
    if v.startswith("ring"):
        return lambda q, k, v_: ring_attention(q, k, v_, group=groups[int(v[-1])], **kw)
    if v.startswith("ulysses"):
        return lambda q, k, v_: ulysses_attention(q, k, v_, group=groups[int(v[-1])], **kw)
    if v == "hybrid_u2r2":
        return lambda q, k, v_: hybrid_attention(q, k, v_, ulysses_group=groups[2], ring_group=groups["ring"][rank % 2], **kw)
    if v.startswith("doc_zigzag"):
        size = int(v[-1])
        return lambda q, k, v_: ring_attention(q, k, v_, group=groups[size], layout=DocumentZigzag(DOC_ZIGZAG[size], size), **kw)
    if v == "all_gather_doc_zigzag4":
        return lambda q, k, v_: all_gather_attention(q, k, v_, group=groups[4], positions=positions, **kw)
    if v == "all_gather_u2r2":
        return lambda q, k, v_: all_gather_attention(q, k, v_, group=groups[4], positions=positions, **kw)
    return lambda q, k, v_: all_gather_attention(q, k, v_, group=groups[int(v[-1])], **kw)


def _run_case(case, groups, rank):
    import torch

    dtype = {"fp32": torch.float32, "fp64": torch.float64}[case["dtype"]]
    h, hk, d = 4, 1 if case["gqa"] else 4, 16
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, dout = (torch.randn(S, 2, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(S, 2, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    ids = full_document_ids(case["docs"], seed=zlib.crc32(case["name"].encode()))
    truth = reference(q, k, v, dout, ids, case["causal"], torch.float64)
    refs = [in_order(lambda *x: reference(*x, ids, case["causal"], torch.float32), perms, q, k, v, dout)
            for perms in reference_orders(16)]
    positions = _positions(case["variant"], rank)
    sh = lambda x: x.index_select(0, positions)  # noqa: E731
    attn = _attn(case, groups, rank, ids[:, positions], positions)

    def cp(ql, kl, vl, doutl):
        ql, kl, vl = (x.to(dtype).requires_grad_() for x in (ql, kl, vl))
        out = attn(ql, kl, vl)
        out.backward(doutl.to(dtype))
        return [out.detach(), ql.grad, kl.grad, vl.grad]

    got = in_order(cp, summation_order_perms(16), sh(q), sh(k), sh(v), sh(dout))
    padding = (ids[:, positions] < 0).t()  # [s_local, b]
    res = error_stats(got, truth, refs, positions)
    res["merge_g"] = merge_sensitivity(q, k, v, dout, document_mask(ids, case["causal"]), 16 ** -0.5)
    res["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
    res["padding_max"] = max([g[padding].abs().max().item() for g in got[:2] if padding.any()] + [0.0])
    return res


def document_mask(ids, causal):
    """[b, s, s]: query i sees key j within its document (never padding), and j <= i when causal."""
    import torch

    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    return mask & torch.ones(S, S, dtype=torch.bool).tril() if causal else mask


def _skipping(groups, rank):
    """Work and bytes of ring4 with document layouts that leave ring steps empty."""
    import torch

    from cp_ext.attention import ring_attention
    from cp_ext.token_partition import context_parallel_positions
    from cp_ext.perf.counter import count_comm, count_work

    res = {}
    positions = context_parallel_positions(S, ring_rank=rank, ring_size=4)
    layouts = {
        "chunk_aligned": torch.arange(S).div(8, rounding_mode="floor"),  # one document per zigzag chunk
        "one_straddles": torch.tensor([0] * 12 + [1] * 4 + [i // 8 + 1 for i in range(16, S)]),  # doc 0: chunks 0-1
        "dense": None,
    }
    for name, row in layouts.items():
        ids = None if row is None else row.expand(2, S)[:, positions].contiguous()
        x = torch.randn(S, 2, 2, 16)[positions].requires_grad_()
        with count_work() as work, count_comm() as comm:
            out = ring_attention(x, x, x, causal=True, group=groups[4], document_ids=ids)
            fwd_bytes = comm.bytes["ring_p2p"]
            out.sum().backward()
        res[name] = dict(tiles=work.calls["tiles"], pairs=work.bytes["pairs"], fwd_bytes=fwd_bytes,
                         total_bytes=comm.bytes["ring_p2p"], kv_bytes=x.nbytes * 2)
    return res


def _bad_inputs(groups):
    import torch

    from cp_ext.attention import ring_attention

    x = torch.randn(16, 2, 2, 8)
    bad = {
        "shape": torch.zeros(2, 15, dtype=torch.int64),
        "dtype": torch.zeros(2, 16),
        "device": torch.zeros(2, 16, dtype=torch.int64, device="meta"),
        "decreasing": torch.tensor([[0] * 8 + [1] * 4 + [0] * 4] * 2),
        "padding_then_document": torch.tensor([[0] * 8 + [-1] * 4 + [1] * 4] * 2),
    }
    msgs = {}
    for name, ids in bad.items():
        try:
            ring_attention(x, x, x, causal=True, group=groups[4], document_ids=ids)
            msgs[name] = None
        except (ValueError, TypeError) as e:
            msgs[name] = str(e)
    return msgs


def main():
    import torch.distributed as dist

    from tests.attention.reference import init_four_ranks

    args = worker_args()
    rank, groups = init_four_ranks()
    groups["ring"] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    # Ulysses pairs are groups[2] ([0, 1], [2, 3]); the ring of a rank is groups["ring"][rank % 2].
    results = {case["name"]: _run_case(case, groups, rank) for case in selected(CASES, args)}
    results["skipping"] = _skipping(groups, rank)
    results["bad"] = _bad_inputs(groups)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
QUICK = "ring4-random-causal-gqa-fp32"  # the edit-run loop's case: ring 4, random documents, causal, GQA


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, cases=[QUICK] if quick else None)


MERGES = {  # T of the bound: the partial results one query row merges
    "ring2": 2, "ring4": 4, "ring4_contiguous": 4,  # ring steps
    "ulysses2": 1, "ulysses4": 1, "hybrid_u2r2": 2,  # one local call; the hybrid's ring of 2
    "all_gather2": 4, "all_gather4": 8, "all_gather_u2r2": 8,  # a query run meets <= 2 key runs per rank
    "doc_zigzag2": 2, "doc_zigzag4": 4, "all_gather_doc_zigzag4": 8,  # a document's 8 chunks at most
}


@pytest.mark.parametrize("case", case_params(CASES, quick=[QUICK]))
def test_documents_match_float64_truth(results, case):
    name = case["name"]
    check_bounds(results, name, case["dtype"], merges=MERGES[case["variant"]])
    assert all(res[name]["finite"] for res in results.values()), "NaN or inf in out/dq/dk/dv"
    assert all(res[name]["padding_max"] == 0.0 for res in results.values()), "padding rows must give exactly 0"


def test_truth_is_the_block_diagonal_mask():
    """The reference really masks: with documents it differs from plain causal attention."""
    import torch

    q = torch.randn(S, 2, 2, 8, dtype=torch.float64)
    docs = reference(q, q, q, q, full_document_ids("short"), True, torch.float64)[0]
    plain = reference(q, q, q, q, torch.zeros(2, S, dtype=torch.int64), True, torch.float64)[0]
    assert (docs - plain).abs().max() > 0.1
    assert torch.allclose(docs[:2], plain[:2], rtol=0, atol=1e-12)  # first documents (3, 2 tokens): same keys


def test_chunk_aligned_documents_compute_one_tile_and_send_nothing(results):
    """One document per zigzag chunk: only the diagonal step has work, so the ring stops after
    it (no KV or dK/dV bytes at all) and each rank computes 1 tile instead of 4."""
    for res in results.values():
        s = res["skipping"]
        assert s["dense"]["tiles"] == 4 and s["chunk_aligned"]["tiles"] == 1, s
        assert s["chunk_aligned"]["total_bytes"] == 0, s
        assert s["chunk_aligned"]["pairs"] == 2 * 2 * (8 * 9 // 2), s  # 2 samples x 2 chunks x causal 8x8
        assert s["dense"]["fwd_bytes"] == 3 * s["dense"]["kv_bytes"], s


def test_one_straddling_document_sends_one_block_one_hop(results):
    """Document 0 spans chunks 0 and 1 (ranks 0 and 1): only rank 1 needs another rank's KV
    (rank 0's, at step 1). So only rank 0 sends, its KV block one hop (forward and backward)
    with its dK/dV accumulator, and rank 1, the block's last reader, sends the accumulator home;
    ranks 2 and 3 send nothing."""
    for rank, res in results.items():
        s = res["skipping"]["one_straddles"]
        kv = s["kv_bytes"]  # fp32 inputs: a dK/dV accumulator has the block's size
        assert s["fwd_bytes"] == {0: kv}.get(rank, 0), (rank, s)
        assert s["total_bytes"] == {0: 3 * kv, 1: kv}.get(rank, 0), (rank, s)  # rank 0: KV fwd + KV, dKV bwd
        assert s["tiles"] == (2 if rank == 1 else 1), (rank, s)


@pytest.mark.quick
@pytest.mark.parametrize("name, words", [
    ("shape", ["[b, s_local]", "[2, 16]", "(2, 15)"]),
    ("dtype", ["integer", "float32"]),
    ("device", ["meta", "q's device"]),
    ("decreasing", ["decrease", "non-decreasing"]),
    ("padding_then_document", ["padding", "end a sample"]),
])
def test_bad_document_ids_are_clear_errors(results, name, words):
    msg = results[0]["bad"][name]
    assert msg is not None, f"{name}: no error"
    for w in words:
        assert w in msg, (w, msg)


if __name__ == "__main__":
    main()
