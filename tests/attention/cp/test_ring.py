"""Ring attention against float64 single-process SDPA on the full sequence.

Worker (`python -m torch.distributed.run --nproc-per-node=4 tests/attention/cp/test_ring.py
--results-dir DIR`): every rank builds the same seeded full tensors, computes the float64
truth and the single-device SDPA in the case's dtype (the reference error), then runs
`ring_attention` on its shard and records the max abs error of out, dq, dk and dv. Rings of
size 2 are the sub-groups [0, 1] and [2, 3]; rings of size 4 are the world.

Bounds (per tensor, max over ranks; `tests.attention.reference.check_bounds`, derived there):
* fp32: RMS error <= 1.5 x the single-device fp32 RMS error; max error <= 2 x single-device fp32
  SDPA error + 1 ulp + (R - 1) merges x u x G (the ring merges R partial results per row), and <= 1e-5;
* bf16/fp16: ring error <= 2 x single-device error of the same dtype + LOW_PREC_SLACK x max|truth|
  (`tests.attention.bounds`: the per-step kernel results are rounded to the dtype before the fp32 accumulation);
  see docs/attention.md.
* fp64: ring error <= 1e-12 (checks the algebra of the merges exactly).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.bounds import LOW_PREC_SLACK  # noqa: E402
from tests.attention.reference import check_bounds, init_four_ranks, measure  # noqa: E402
from tests.launch import case_params, launch, worker_args, write_results  # noqa: E402

NPROC = 4


def _cases():
    cases = []
    for ring in (2, 4):
        for causal in (True, False):
            for gqa in (False, True):
                for hd in (64, 80):
                    for dtype in ("fp32", "bf16"):
                        s = 2 * ring * (6 if hd == 64 else 15) if ring == 4 else 2 * ring * (12 if hd == 64 else 15)
                        cases.append(dict(ring=ring, causal=causal, gqa=gqa, hd=hd, s=s, dtype=dtype, layout="zigzag"))
    for ring, causal, gqa in [(4, True, False), (4, True, True), (4, False, True), (2, True, True)]:
        cases.append(dict(ring=ring, causal=causal, gqa=gqa, hd=64, s=8 * ring * 3, dtype="fp32", layout="contiguous"))
    for layout in ("zigzag", "contiguous"):
        cases.append(dict(ring=4, causal=True, gqa=True, hd=80, s=72, dtype="fp64", layout=layout))
    cases.append(dict(ring=4, causal=True, gqa=True, hd=64, s=72, dtype="fp16", layout="zigzag"))
    for c in cases:
        c["name"] = (f"ring{c['ring']}-{'causal' if c['causal'] else 'full'}-{'gqa' if c['gqa'] else 'mha'}"
                     f"-d{c['hd']}-s{c['s']}-{c['dtype']}-{c['layout']}")
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------- worker
def _run_case(case, groups, recorder):
    import torch.distributed as dist

    from cp_ext.attention import ring_attention
    from cp_ext.token_partition import context_parallel_positions

    group = groups[case["ring"]]
    r, size = dist.get_rank(group), dist.get_world_size(group)
    positions = context_parallel_positions(case["s"], ring_rank=r, ring_size=size, layout=case["layout"])

    def attn(ql, kl, vl):
        recorder.clear()
        return ring_attention(ql, kl, vl, causal=case["causal"], group=group, layout=case["layout"])

    res = measure({**case, "h": 4, "hk": 2 if case["gqa"] else 4, "d": case["hd"]}, attn, positions)
    res["ring_err"] = res.pop("err")
    res["kv_heads_sent"] = sorted({shape[2] for kind, shape in recorder if kind == "post" and len(shape) == 5 and shape[0] == 2})
    return res


def main():
    import torch
    import torch.distributed as dist

    from cp_ext.attention import kernels, ring_attention
    from cp_ext.attention.cp import primitives as utils

    args = worker_args()
    rank, groups = init_four_ranks()

    # Record the order of comm posts / waits / kernel calls (overlap) and what is sent (GQA).
    events = []
    orig_send, orig_wait = utils.RingComm.send_recv, utils.RingComm.wait
    orig_fwd, orig_bwd = kernels.AttnKernel.forward, kernels.AttnKernel.backward

    def send_recv(self, t, *a, **kw):
        events.append(("post", tuple(t.shape)))
        return orig_send(self, t, *a, **kw)

    def wait(self):
        events.append(("wait", ()))
        return orig_wait(self)

    def fwd(self, *a, **kw):
        events.append(("fwd", ()))
        return orig_fwd(self, *a, **kw)

    def bwd(self, *a, **kw):
        events.append(("bwd", ()))
        return orig_bwd(self, *a, **kw)

    utils.RingComm.send_recv, utils.RingComm.wait = send_recv, wait
    kernels.AttnKernel.forward, kernels.AttnKernel.backward = fwd, bwd

    results = {}
    for case in CASES:
        results[case["name"]] = _run_case(case, groups, events)
        if case["name"] == "ring4-causal-gqa-d64-s48-fp32-zigzag":
            results["events"] = [kind for kind, _ in events]

    # A shard that is not two equal chunks: clear error.
    import torch as _t
    x = _t.randn(7, 1, 2, 16)
    try:
        ring_attention(x, x, x, causal=True, group=dist.group.WORLD)
        results["bad_len_msg"] = None
    except ValueError as e:
        results["bad_len_msg"] = str(e)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def results():
    return launch(__file__, NPROC)


def _max(results, name, key, t):
    return max(res[name][key][t] for res in results.values())


@pytest.mark.parametrize("case", case_params(CASES, quick=["ring4-causal-gqa-d64-s48-fp32-zigzag"]))
def test_ring_matches_float64_truth(results, case):
    name = case["name"]
    assert all(res[name]["dtypes_ok"] for res in results.values())
    check_bounds(results, name, case["dtype"], merges=case["ring"], low_prec_slack=LOW_PREC_SLACK.get(case["dtype"], 0.0),
                 key="ring_err")


@pytest.mark.parametrize("case", [c for c in CASES if c["gqa"]][:4], ids=lambda c: c["name"])
def test_gqa_kv_travels_unexpanded(results, case):
    for res in results.values():
        assert res[case["name"]]["kv_heads_sent"] == [2], "KV must travel with its own (2) heads"


def test_next_block_in_flight_while_computing(results):
    """Ring of 4: the next KV is posted before each kernel call and waited for after it."""
    ev = results[0]["events"]
    split = len(ev) - ev[::-1].index("fwd")
    fwd, bwd = ev[:split], ev[split:]
    assert fwd == ["post", "fwd", "wait"] * 3 + ["fwd"], fwd
    steps = [i for i, e in enumerate(bwd) if e == "bwd"]
    assert len(steps) == 4, bwd
    for i in steps[:-1]:  # the kernel runs with the next KV block already in flight
        assert bwd[i - 1] == "post", bwd
    assert bwd.count("post") == 3 + 4, bwd  # 3 KV hops + 4 dKV hops (the last brings dKV home)


@pytest.mark.quick
def test_bad_sequence_length_is_a_clear_error(results):
    msg = results[0]["bad_len_msg"]
    assert msg is not None and "28" in msg and "2 x C = 2 x 4 = 8" in msg and "pad" in msg, msg


def test_balance_tool_zigzag_within_5_percent(capsys):
    """tools/attention_balance.py's table (`cp_ext.bench.attention_balance`) replays `RingSchedule`: every causal
    pair once, zigzag max/mean <= 1.05."""
    from cp_ext.bench.attention_balance import print_balance

    assert print_balance(seq_len_per_chunk=6) == 0
    assert "zigzag worst max/mean = 1.0000" in capsys.readouterr().out


if __name__ == "__main__":
    main()
