"""The library's ring on C = 4 ranks of one device, against float64 truth: the GPU check's ring rows.

Each ring rank is a process on the same device, talking over gloo (NCCL refuses two ranks on one
GPU). Every rank draws the same seeded full tensors (`tests.gpu.one_device.inputs`), keeps its
zigzag shard as ring_attention hands it to the ring ([b, h, s/C, d] views of [s/C, b, h, d]
tensors) and calls `cp_ext.attention.cp.ring.ring_attn_forward` / ``ring_attn_backward`` with the
kernel under test: the library's schedule (`RingSchedule`: s = 200 is 8 chunks of 25, so every
step after the first is a half tile of 25 rows), its merges, its fp32 accumulators and its dK/dV
hops, nothing copied. Only the transport is adapted: gloo's send/recv read and write a tensor's
memory directly (its point-to-point never stages CUDA tensors), so what the ring sends travels
through host memory (`_through_host`; on the CPU too, so the suite runs that path).

A case is a dict: ``name``, ``kernel`` (a `KERNELS` name), ``dtype`` ("fp64" ...), ``causal``,
``gqa`` (GQA 8/2, else MHA 8/8), ``docs`` (packed `document_ids`), ``per_document`` (dynamic CP's layout:
the documents of `PER_DOCUMENT`, each zigzagged over the ring on its own), ``s`` (default 200) and
``hook``: None, or "module:function", called on every rank as ``function(kernel, report)``
around the case: a context manager that yields the kernel to run (a broken one, a fake, or the
same) and may fill the dict ``report`` (each rank's, returned with the case). A kernel that
raises inside a tile does not stop the ring (the other ranks' messages still flow): the tile
computes nothing and the case comes back with the ``error``, a FAIL row, while the rest run.

Each case is gathered and judged on one rank, the same for every case of the same inputs (the ranks
share the work, and each input's truth is computed once): the full-sequence out, LSE, dq, dk, dv
against float64 truth, ``{name: {err, ref_err, max_truth, dtypes_ok, error, report}}``.
All cases run in one launch (`run_ring_cases`): starting processes is what costs on a small machine.
"""

import argparse
import contextlib
import importlib
import json
import tempfile
from pathlib import Path

import torch

from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.cp.ring import ring_attn_backward, ring_attn_forward
from cp_ext.attention.cp.primitives import accum_dtype
from cp_ext.token_partition import DocumentZigzag, zigzag_positions
from tests.gpu.one_device import (DTYPES, SIM, document_attention, document_ids, inputs, max_err,
                                  reference_errors, single_device)
from tests.gpu.rows import FAIL, judge, row
from tests.gpu.runs import run_logged, tail, torchrun
from tests.launch import launch, session_dir

TENSORS = ("out", "lse", "dq", "dk", "dv")


# Dynamic CP's layout: documents of these lengths (multiples of 2 x C, summing to s), each zigzagged over the ring
# on its own (`cp_ext.token_partition.DocumentZigzag`), with their ids
PER_DOCUMENT = (48, 104, 8, 40)


def ring_case(name, kernel, dtype, causal, gqa, docs=False, s=SIM["s"], hook=None, per_document=False):
    return dict(name=name, kernel=kernel, dtype=dtype, causal=causal, gqa=gqa, docs=docs, s=s, hook=hook,
                per_document=per_document)


def _per_document_ids(s):
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(PER_DOCUMENT)])
    assert ids.numel() == s, (PER_DOCUMENT, s)
    return torch.stack([ids, ids])


def ring_row(check, dtype, result):
    """A case's summary row: judged against its bounds, or a FAIL with the error a rank met."""
    if result.get("error"):
        return row("single", check, FAIL, result["error"])
    return judge("single", check, dtype, result["err"], result["ref_err"], result["max_truth"], result["dtypes_ok"])


def run_ring_cases(cases, device, timeout, log_dir=None):
    """{case name: its result} for every case, from one launch of ``SIM["ring"]`` ranks on ``device``;
    ``log_dir``: where a CUDA launch's log goes (default: the test session's temporary directory)."""
    run_dir = Path(tempfile.mkdtemp(prefix="ring_", dir=session_dir()))
    (run_dir / "cases.json").write_text(json.dumps(cases))
    args = ["--device", device.type, "--cases-file", run_dir / "cases.json"]
    if device.type == "cpu":
        ranks = launch(__file__, SIM["ring"], *args, timeout=timeout).values()
    else:
        # Fresh processes, not the test fork server's children: CUDA cannot be used in a process forked
        # from one that initialized it, and the server imports megatron-core (and TE, where installed).
        log = Path(log_dir or run_dir) / "ring.log"
        rc = run_logged(torchrun(SIM["ring"]) + [__file__, "--results-dir", run_dir, *args], log, timeout)
        assert rc == 0, f"the ring's ranks {'timed out' if rc == 124 else f'exited {rc}'}; see {log}: {tail(log)}"
        ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(SIM["ring"])]
    return {name: result for judged in ranks for name, result in judged.items()}


class _Guarded:
    """The kernel under test; an exception inside a tile is kept (the first one) and the tile computes
    nothing, so this rank still sends and receives what the others expect."""

    def __init__(self, kernel):
        self.kernel, self.error = kernel, None

    def _failed(self, e):
        self.error = self.error or f"{type(e).__name__}: {e}"[:300]

    def forward_blocks(self, q, k, v, blocks, **kw):
        try:
            return self.kernel.forward_blocks(q, k, v, blocks, **kw)
        except Exception as e:
            self._failed(e)
            return (q.new_zeros(q.shape[:3] + v.shape[-1:]),
                    torch.full(q.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device))

    def backward_blocks(self, dout, q, k, v, out, lse, blocks, **kw):
        try:
            return self.kernel.backward_blocks(dout, q, k, v, out, lse, blocks, **kw)
        except Exception as e:
            self._failed(e)
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _through_host():
    """gloo's isend / irecv and all_gather (the ring's messages and its gather of the document ids), with
    every tensor staged in host memory: a copy is sent, and what arrives lands in a host buffer that is
    copied into the ring's tensor when the ring waits for it."""
    import torch.distributed as dist

    isend, irecv, all_gather = dist.isend, dist.irecv, dist.all_gather

    class Received:
        def __init__(self, work, host, tensor):
            self.work, self.host, self.tensor = work, host, tensor

        def wait(self, *args, **kwargs):
            done = self.work.wait(*args, **kwargs)
            self.tensor.copy_(self.host)
            return done

    def send(tensor, *args, **kwargs):
        return isend(tensor.cpu(), *args, **kwargs)  # gloo's work keeps the copy until it is sent

    def recv(tensor, *args, **kwargs):
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return Received(irecv(host, *args, **kwargs), host, tensor)

    def gather(tensors, tensor, *args, **kwargs):  # as the library calls it: synchronous
        hosts = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        done = all_gather(hosts, tensor.cpu(), *args, **kwargs)
        for t, host in zip(tensors, hosts):
            t.copy_(host)
        return done

    dist.isend, dist.irecv, dist.all_gather = send, recv, gather


def _hook(case):
    if not case["hook"]:
        return lambda kernel, report: contextlib.nullcontext(kernel)
    module, name = case["hook"].split(":")
    return getattr(importlib.import_module(module), name)


def _run_case(case, device, rank, size):
    """This rank's part of one case: its shard through the library's ring (out, lse, dq, dk, dv as
    float64 CPU tensors, in kernel layout), whether they came back in the right dtypes, and any error."""
    dtype, s = DTYPES[case["dtype"]], case["s"]
    layout = DocumentZigzag(PER_DOCUMENT, size) if case.get("per_document") else "zigzag"
    pos = layout.positions(rank) if case.get("per_document") else zigzag_positions(s, rank, size)
    local = lambda x: x.permute(2, 0, 1, 3).index_select(0, pos).to(device, dtype).permute(1, 2, 0, 3)  # noqa: E731
    q, k, v, dout = map(local, inputs(case["causal"], case["gqa"], s))
    ids = _case_ids(case)[:, pos].to(device) if case["docs"] else None
    report = {}
    kernel = get_kernel(device, dtype, case["kernel"], head_dim=SIM["d"])
    with _hook(case)(kernel, report) as kernel:
        guarded = _Guarded(kernel)
        kw = dict(softmax_scale=SIM["d"] ** -0.5, causal=case["causal"], group=None, kernel=guarded, document_ids=ids,
                  layout=layout)
        out, lse = ring_attn_forward(q, k, v, **kw)
        dq, dk, dv = ring_attn_backward(dout, q, k, v, out, lse, **kw)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    ok = all(got[t].dtype == dtype for t in ("out", "dq", "dk", "dv")) and lse.dtype == accum_dtype(dtype)
    return dict(pos=pos, got={t: x.double().cpu() for t, x in got.items()}, ok=ok, error=guarded.error, report=report)


def _case_ids(case):
    return _per_document_ids(case["s"]) if case.get("per_document") else document_ids(case["s"])


def _inputs_key(case):
    return case["causal"], case["gqa"], case["docs"], case["s"], bool(case.get("per_document"))


def _truth_and_reference(case, device, cache):
    """(float64 truth, (ref_err, max_truth)) of the case's inputs, kept in ``cache``."""
    key = _inputs_key(case)
    x = inputs(case["causal"], case["gqa"], case["s"])
    if case["docs"]:
        ids = _case_ids(case)
        attention = lambda dtype, dev: document_attention(*x, ids, ids, case["causal"], dtype, dev)  # noqa: E731
    else:
        attention = lambda dtype, dev: single_device(*x, case["causal"], dtype, dev)  # noqa: E731
    if key not in cache:
        cache[key] = attention(torch.float64, "cpu")
    if (key, case["dtype"]) not in cache:
        cache[key, case["dtype"]] = reference_errors(attention(DTYPES[case["dtype"]], device), cache[key])
    return cache[key], cache[key, case["dtype"]]


def _judge(case, parts, device, cache):
    """The errors of the full sequence gathered from every rank's ``parts``."""
    errors = [p["error"] for p in parts if p["error"]]
    result = dict(error=errors[0] if errors else None, report=[p.get("report") for p in parts])
    if any("got" not in p for p in parts):
        return result
    order = torch.cat([p["pos"] for p in parts])  # the global position of each gathered row

    def full(t):  # every rank's [b, h, s/C(, d)] -> the full sequence's [b, h, s(, d)]
        cat = torch.cat([p["got"][t] for p in parts], 2)
        return torch.empty_like(cat).index_copy_(2, order, cat)

    truth, (ref_err, max_truth) = _truth_and_reference(case, device, cache)
    err = {t: max_err(full(t), truth[t]) for t in TENSORS}
    return dict(result, err=err, ref_err=ref_err, max_truth=max_truth, dtypes_ok=all(p["ok"] for p in parts))


def main():
    import torch.distributed as dist

    from tests.launch import worker_args, write_results

    args = worker_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--cases-file", required=True)
    opts = parser.parse_args(args.extra)
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 rows mean fp32
    if opts.device == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("gloo")
    _through_host()
    rank, size = dist.get_rank(), dist.get_world_size()
    judged, cache = {}, {}
    cases = json.loads(Path(opts.cases_file).read_text())
    keys = list(dict.fromkeys(map(_inputs_key, cases)))  # each input's truth and references on one rank only
    for case in cases:
        try:
            mine = _run_case(case, device, rank, size)
        except Exception as e:  # raised outside the tiles, e.g. building the kernel: alike on every rank
            mine = dict(error=f"{type(e).__name__}: {e}"[:300])
        judge_rank = keys.index(_inputs_key(case)) % size
        parts = [None] * size if rank == judge_rank else None
        dist.gather_object(mine, parts, dst=judge_rank)
        if parts is not None:
            try:
                judged[case["name"]] = _judge(case, parts, device, cache)
            except Exception as e:
                judged[case["name"]] = dict(error=f"judging: {type(e).__name__}: {e}"[:300])
    write_results(args.results_dir, judged)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
