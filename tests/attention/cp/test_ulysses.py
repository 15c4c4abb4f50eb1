"""Ulysses attention against float64 single-process SDPA on the full sequence.

Worker (`python -m torch.distributed.run --nproc-per-node=4 tests/attention/cp/test_ulysses.py
--results-dir DIR`): every rank builds the same seeded full tensors, computes the float64
truth and single-device SDPA in the case's dtype (the reference error), shards q, k, v and
dout with `context_parallel_positions` (ring size 1) + `index_select` (the layout the model
uses), runs `ulysses_attention` and records the max abs error of out, dq, dk and dv.
Ulysses groups of 2 are [0, 1] and [2, 3]; the group of 4 is the world. b = 2, h = 4 query
heads (8 and 12 in two cases), KV heads 4 (MHA), 2 and 1 (GQA; KV heads < U for U = 4, and
for hk = 1 also U = 2), head_dim 64 / 80, sequence lengths 24, 40, 56.

Bounds (per tensor, max over ranks), unit-variance inputs, default scale:
* fp32: RMS error <= 1.5 x single-device fp32 RMS error; max error <= 2 x single-device fp32 SDPA
  error + 1 ulp, and <= 1e-5 (one kernel call per row: no merge term; derived in
  `tests.attention.reference`);
* fp64: error <= 1e-12 (the exchange and head bookkeeping are exact);
* bf16: error <= 2 x single-device bf16 SDPA error. Measured: Ulysses runs the same kernel
  over the same whole sequence as the single-device reference, so its bf16 error is at most
  the reference error (max ratio 1.00 for out/dq; 0.59-1.0 for the GQA dk/dv, whose replica
  sums are rounded once from fp32), e.g. out 1.25e-2, dv 3.7e-2 vs max|truth| ~ 1-10.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.recorders import record_all_to_all  # noqa: E402
from tests.attention.reference import check_bounds as _check_bounds, init_four_ranks, measure, value_errors  # noqa: E402
from tests.launch import case_params, launch, worker_args, write_results  # noqa: E402

NPROC = 4
BF16_SLACK = 0.0  # x max|truth|, on top of 2 x the single-device bf16 error


def _case(U, causal, hk, d=64, s=24, dtype="fp32", h=4):
    name = f"u{U}-{'causal' if causal else 'full'}-h{h}kv{hk}-d{d}-s{s}-{dtype}"
    return dict(U=U, causal=causal, h=h, hk=hk, d=d, s=s, dtype=dtype, name=name)


def _cases():
    cases = []
    lengths = iter([24, 40, 56] * 4)
    for U in (2, 4):
        for causal in (True, False):
            for hk in (4, 2, 1):
                cases.append(_case(U, causal, hk, s=next(lengths)))
    cases += [
        _case(2, True, 1, d=80, s=40),
        _case(4, False, 2, d=80, s=24),
        _case(4, True, 2, h=8, s=24),   # 2 query heads per rank share one KV replica
        _case(4, True, 6, h=12, s=24),  # hk = 6, U = 4: neither divides the other, rep = 2
        _case(2, True, 1, s=56, dtype="bf16"),
        _case(4, True, 2, d=80, s=40, dtype="bf16"),
        _case(4, False, 4, s=24, dtype="bf16"),
        _case(4, True, 1, d=80, s=40, dtype="fp64"),
        _case(2, False, 2, s=24, dtype="fp64"),
    ]
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------- worker
def _errors(group):
    import torch

    from cp_ext.attention import ulysses_attention

    def call(h, hk):
        q, kv = torch.randn(8, 1, h, 16), torch.randn(8, 1, hk, 16)
        return lambda: ulysses_attention(q, kv, kv, causal=True, group=group)

    return value_errors({key: call(h, hk) for key, h, hk in [("h6_u4", 6, 6), ("h6_kv1_u4", 6, 1), ("h4_kv3_u4", 4, 3)]})


def main():
    import torch.distributed as dist

    from cp_ext.attention import ulysses_attention
    from cp_ext.token_partition import context_parallel_positions

    args = worker_args()
    rank, groups = init_four_ranks()
    sends = record_all_to_all()

    results = {}
    for case in CASES:
        group = groups[case["U"]]
        pos = context_parallel_positions(
            case["s"], ring_rank=0, ring_size=1, ulysses_rank=dist.get_rank(group), ulysses_size=case["U"]
        )
        attn = lambda q, k, v: ulysses_attention(q, k, v, causal=case["causal"], group=group)
        sends.clear()
        fwd_sends = []
        res = measure(case, attn, pos, on_forward=lambda: fwd_sends.extend(sends))
        res["fwd_heads_sent"] = [shape[3] for shape in fwd_sends]  # send buffers are [U, s, b, heads/U, d]
        res["n_all_to_all"] = len(sends)
        results[case["name"]] = res
    results["errors"] = _errors(dist.group.WORLD)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def results():
    return launch(__file__, NPROC)


def check_bounds(results, case):
    assert all(res[case["name"]]["dtypes_ok"] for res in results.values()), "dtype or shape of out/dq/dk/dv changed"
    _check_bounds(results, case["name"], case["dtype"], merges=1, low_prec_slack=BF16_SLACK)  # one kernel call per row


@pytest.mark.parametrize("case", case_params(CASES, quick=["u2-causal-h4kv2-d64-s40-fp32"]))
def test_ulysses_matches_float64_truth(results, case):
    check_bounds(results, case)


@pytest.mark.parametrize("case", [c for c in CASES if c["dtype"] == "fp32" and c["d"] == 64][:12], ids=lambda c: c["name"])
def test_exchange_sends_only_needed_heads(results, case):
    """Forward: q, k, v and the output each take one all-to-all; KV is replicated only up to
    one copy per rank that needs it (hk < U: U heads in all, 1 per rank), never to h heads."""
    U, h, hk = case["U"], case["h"], case["hk"]
    kv_per_rank = max(hk // U, 1)
    for res in results.values():
        assert res[case["name"]]["fwd_heads_sent"] == [h // U, kv_per_rank, kv_per_rank, h // U]
        assert res[case["name"]]["n_all_to_all"] == 8  # + dout, dq, dk, dv in the backward


def test_gqa_replication_with_uneven_kv_heads(results):
    """h = 12, hk = 6 over U = 4: each KV head doubled (12 copies), 3 per rank, beside 3 query heads."""
    res = results[0]["u4-causal-h12kv6-d64-s24-fp32"]
    assert res["fwd_heads_sent"] == [3, 3, 3, 3]


@pytest.mark.quick
def test_heads_not_divisible_by_ulysses_size_is_a_clear_error(results):
    msgs = results[0]["errors"]
    for key in ("h6_u4", "h6_kv1_u4"):
        msg = msgs[key]
        assert msg is not None and "--ulysses-size 4" in msg and "6 query heads" in msg and "[1, 2, 3, 6]" in msg, msg
    assert msgs["h4_kv3_u4"] is not None and "GQA" in msgs["h4_kv3_u4"], msgs["h4_kv3_u4"]


if __name__ == "__main__":
    main()
