"""The GPU check's linear-attention rows: fla's Triton kernels against cp_ext's torch rule, and the CP
state-passing op at CP2 over gloo, each against float64 truth on the CPU.

Inputs (`case_inputs`): `tests.linear_attention.reference`'s seeded float64 draws, on CUDA b = 3 rows of s = 300
tokens (CP2 zigzag: four segments of 75, so fla's 64-token chunks end inside segments), h_k 2 / h_v 4 (grouped
value heads), K = 64 and V = 128 (K != V: a transposed state cannot pass), packed documents
(`reference.documents`: row 0 starts documents at a segment boundary, inside segments and one token long;
row 1 once inside a segment; row 2 is one document, so its summary's M is not zero). On the CPU (the
tool's --device cpu) the same rows at toy sizes (`SIZES`). Gated DeltaNet ("gdn", g per head) and KDA
("kda", g per key channel). Truth: the torch rule in float64 on the CPU (equal to the token-by-token
recurrence and to transformers' rules at 1e-10: tests/linear_attention).

Measure, per tensor: rms(got - truth) / rms(truth), the measure of fla's own tests (`rms_error`); for the summary's
M, rms(got - truth) / rms(I): M is the map the fold applies to a state, so its error counts relative to the
identity it starts from, not to itself (the decays take it to ~1e-39 over 300 tokens, below fp32's normal
range, where a relative measure reads rounding as failure). "ref" is the
torch rule on the check's device in the same dtype against the same truth (its error is mostly the inputs'
rounding to the dtype). Bound per tensor: 2 x ref + ``TOL[kernel][dtype]``:

* fla: fla's own test tolerances (fla-org/flash-linear-attention tests/ops/test_gated_delta.py and test_kda.py,
  fp16 inputs: o and the final state 0.005; dq, dk, dv, dh0 0.008; dg, dbeta 0.02; o0 / Qtilde as o, M / E as the
  final state), as they are for fp32 (fla's fp32 products run in TF32, whose 10-bit mantissa is fp16's) and
  x 8 for bf16 (3 mantissa bits fewer). Not yet measured on a GPU.
* torch (the CP rows where fla is missing, and the CPU): fp32 2**-20 (a few fp32 roundings), bf16 2**-8 (an
  output or gradient rounded to bf16 on the other side of a tie).

Rows:

* ``fla gated delta rule KIND DTYPE``: ``gated_delta_rule(kernel="fla")``: o, the final state and the gradients
  of q, k, v, g, beta and the initial state; q and k un-normalized with ``qk_l2norm`` (fla's in-kernel norm),
  an initial state, row 0's first token starting a document (``previous_document_id``).
* ``fla segment summary KIND DTYPE``: ``segment_summary(kernel="fla")``: o0, Qtilde, M, E and every input's
  gradient through all four (row 0 again starting at its first token).
* ``gated delta CP2 gloo KIND DTYPE``: `context_parallel_gated_delta` on 2 ranks of the check's device, zigzag,
  with the documents: gloo all-gathers the segments' (M, E) (it carries CUDA tensors there; NCCL refuses two
  ranks on one GPU). The kernel is what ``kernel="auto"`` picks there (fla on a GPU with fla installed, else
  the torch rule; the row's detail says which), and "ref" is the single-device rule with that kernel: o and
  the gradients of q, k, v, g, beta.

Each CP case runs on fresh ranks (torchrun on CUDA: CUDA cannot be used in a process forked from one that
initialized it; forked from the test fork server on the CPU), is judged on rank 0, and comes back as JSON.
"""

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from cp_ext.linear_attention import context_parallel_gated_delta, fla_kernels, gated_delta_rule, segment_summary
from cp_ext.token_partition import context_parallel_positions
from tests.attention.bounds import ratio_to_bound
from tests.gpu.rows import FAIL, PASS, row
from tests.gpu.runs import run_logged, tail, torchrun
from tests.launch import launch, session_dir
from tests.linear_attention.reference import documents, inputs, seed_of

KINDS = ("gdn", "kda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = {"cuda": dict(b=3, s=300, hk=2, hv=4, kd=64, vd=128), "cpu": dict(b=3, s=40, hk=1, hv=2, kd=8, vd=16)}
CP = 2
TRUTH_CHUNK = 16  # the float64 truth's chunk (KDA's pairwise decays are O(chunk^2 K) per chunk)
FLA_CHECK = "fla kernels vs torch rule (gated delta rule, segment summary)"
CP_CHECK = "gated delta CP2 over gloo vs one device"
RULE_TENSORS = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
SUMMARY_TENSORS = ("o0", "qtilde", "M", "E", "dq", "dk", "dv", "dg", "dbeta")
CP_TENSORS = ("out", "dq", "dk", "dv", "dg", "dbeta")
_FLA_TOL = dict(out=0.005, state=0.005, o0=0.005, qtilde=0.005, M=0.005, E=0.005, dq=0.008, dk=0.008, dv=0.008,
                dh0=0.008, dg=0.02, dbeta=0.02)
TOL = {"fla": {"fp32": _FLA_TOL, "bf16": {t: 8 * x for t, x in _FLA_TOL.items()}},
       "torch": {"fp32": dict.fromkeys(_FLA_TOL, 2.0 ** -20), "bf16": dict.fromkeys(_FLA_TOL, 2.0 ** -8)}}


def rule_label(kind, dtype):
    return f"fla gated delta rule {kind} {dtype}"


def summary_label(kind, dtype):
    return f"fla segment summary {kind} {dtype}"


def cp_label(kind, dtype):
    return f"gated delta CP{CP} gloo {kind} {dtype}"


CP_CASES = [dict(name=cp_label(kind, dt), kind=kind, dtype=dt) for kind in KINDS for dt in DTYPES]


def fla_missing(device):
    """None if fla runs here (both decays), else why not."""
    for per_channel in (False, True):
        why = fla_kernels.fla_problem(device.type, (torch.bfloat16,) * 3, SIZES["cuda"]["kd"], per_channel)
        if why:
            return why
    return None


def kernel_here(device, dtype, kind):
    """The kernel ``kernel="auto"`` runs for this case on ``device``."""
    missing = fla_kernels.fla_problem(device.type, (DTYPES[dtype],) * 3, SIZES[device.type]["kd"], kind == "kda")
    return "torch" if missing else "fla"


def case_inputs(kind, device_type):
    """(float64 CPU tensors q, k, v, g, beta, dout, initial state, dstate; document ids [b, s]; the
    previous-document ids that make row 0's first token a document start)."""
    z = SIZES[device_type]
    x = inputs(z["b"], z["s"], z["hk"], z["hv"], z["kd"], z["vd"], seed_of(f"gpu-{kind}"), per_channel=kind == "kda")
    gen = torch.Generator().manual_seed(seed_of(f"gpu-{kind}-state"))
    x["state"] = torch.randn(z["b"], z["hv"], z["kd"], z["vd"], generator=gen, dtype=torch.float64)
    x["dstate"] = torch.randn(z["b"], z["hv"], z["kd"], z["vd"], generator=gen, dtype=torch.float64)
    # un-normalized q, k for qk_l2norm (the draws come L2-normalized): a spread of norms per token
    x["q_raw"], x["k_raw"] = (x[n] * (0.5 + 2 * torch.rand(x[n].shape[:-1] + (1,), generator=gen, dtype=torch.float64))
                              for n in ("q", "k"))
    ids = documents(z["b"], z["s"], z["s"] // (2 * CP))
    previous = ids[:, 0].clone()
    previous[0] -= 1
    return x, ids, previous


def rms_error(got, truth, norm=None):
    """rms(got - truth) / rms(truth) in float64 on the CPU (NaN if got has one); ``norm``: the 2-norm to divide by
    instead of truth's."""
    diff = (got.detach().double().cpu() - truth).norm().item()
    norm = truth.norm().item() if norm is None else norm
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def _identity_norm(transition):
    """The 2-norm of the identity maps stacked as M [b, h, K, K] is: sqrt(b h K)."""
    b, h, kd, _ = transition.shape
    return math.sqrt(b * h * kd)


def _leaves(tensors, device, dtype):
    """Each tensor on ``device`` in ``dtype`` (initial states in the rule's state dtype), requiring grad."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [t.to(device, state_dtype if name == "state" else dtype).detach().requires_grad_() for name, t in tensors]


def _back(x):
    return x.detach().double().cpu()


def run_rule(kind, device_type, device, dtype, kernel, chunk):
    """The rule row's tensors (float64, CPU) from ``kernel`` on ``device`` in ``dtype``."""
    x, ids, previous = case_inputs(kind, device_type)
    names = ("q_raw", "k_raw", "v", "g", "beta", "state")
    q, k, v, g, beta, state = _leaves([(n, x[n]) for n in names], device, dtype)
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, document_ids=ids.to(device),
                                previous_document_id=previous.to(device), qk_l2norm=True, chunk_size=chunk,
                                kernel=kernel)
    ((o.double() * x["dout"].to(device)).sum() + (final.double() * x["dstate"].to(device)).sum()).backward()
    return dict(zip(RULE_TENSORS, map(_back, (o, final, q.grad, k.grad, v.grad, g.grad, beta.grad, state.grad))))


def run_summary(kind, device_type, device, dtype, kernel, chunk):
    """The summary row's tensors (float64, CPU) from ``kernel`` on ``device`` in ``dtype``."""
    x, ids, previous = case_inputs(kind, device_type)
    q, k, v, g, beta = _leaves([(n, x[n]) for n in ("q", "k", "v", "g", "beta")], device, dtype)
    fields = segment_summary(q, k, v, g, beta, document_ids=ids.to(device), previous_document_id=previous.to(device),
                             chunk_size=chunk, kernel=kernel)
    gen = torch.Generator().manual_seed(seed_of(f"gpu-{kind}-cotangents"))
    loss = sum((f.double() * torch.randn(f.shape, generator=gen, dtype=torch.float64).to(device)).sum() for f in fields)
    loss.backward()
    return dict(zip(SUMMARY_TENSORS, map(_back, (*fields, q.grad, k.grad, v.grad, g.grad, beta.grad))))


def _cp_reference(kind, device_type, device, dtype, kernel, chunk):
    """The CP case's single-device tensors: the plain rule on the whole sequence (zero initial state)."""
    x, ids, _ = case_inputs(kind, device_type)
    q, k, v, g, beta = _leaves([(n, x[n]) for n in ("q", "k", "v", "g", "beta")], device, dtype)
    o, _ = gated_delta_rule(q, k, v, g, beta, document_ids=ids.to(device), qk_l2norm=kind == "kda", chunk_size=chunk,
                            kernel=kernel)
    (o.double() * x["dout"].to(device)).sum().backward()
    return dict(zip(CP_TENSORS, map(_back, (o, q.grad, k.grad, v.grad, g.grad, beta.grad))))


def judged_row(check, kernel, dtype, got, truth, ref, **detail):
    """One row: every tensor's rms error within 2 x ref + TOL[kernel][dtype] (NaN is over); M's against rms(I)."""
    norms = {t: _identity_norm(truth[t]) if t == "M" else None for t in truth}
    err = {t: rms_error(got[t], truth[t], norms[t]) for t in truth}
    ref_err = {t: rms_error(ref[t], truth[t], norms[t]) for t in truth}
    tol = TOL[kernel][dtype]
    bounds = {t: 2 * ref_err[t] + tol[t] for t in truth}
    ratio = {t: ratio_to_bound(err[t], bounds[t]) for t in truth}
    worst = max(ratio, key=ratio.get)
    status = PASS if all(r <= 1 for r in ratio.values()) else FAIL
    bound = f"{bounds[worst]:.2e} = 2 ref + {tol[worst]:g}"
    return row("single", check, status, f"{worst} rms {err[worst]:.2e}", bound, err=err, ref_err=ref_err,
               bounds=bounds, kernel=kernel, measure="rms(got - truth) / rms(truth)", **detail)


def fla_rows(device, budget, cache):
    """The fla rows, rule and summary, for each kind x dtype; an exception in one is that row's FAIL."""
    rows = []
    for kind in KINDS:
        for dtype in DTYPES:
            for label, run in ((rule_label, run_rule), (summary_label, run_summary)):
                check = label(kind, dtype)
                try:
                    budget.left(120)
                    key = (run.__name__, kind)
                    if key not in cache:
                        cache[key] = run(kind, device.type, torch.device("cpu"), torch.float64, "torch", TRUTH_CHUNK)
                    ref = run(kind, device.type, device, DTYPES[dtype], "torch", 64)
                    got = run(kind, device.type, device, DTYPES[dtype], "fla", 64)
                    rows.append(judged_row(check, "fla", dtype, got, cache[key], ref, sizes=SIZES[device.type]))
                except Exception as e:
                    rows.append(row("single", check, FAIL, f"{type(e).__name__}: {e}"[:300]))
    return rows


# ------------------------------------------------------------------------------------------------ the CP cases
def run_cp_cases(device, timeout, log_dir=None):
    """{case name: rank 0's judgement} for every `CP_CASES` case, from one launch of ``CP`` ranks on ``device``."""
    run_dir = Path(tempfile.mkdtemp(prefix="linear_cp_", dir=session_dir()))
    args = ["--device", device.type]
    if device.type == "cpu":
        ranks = launch(__file__, CP, *args, timeout=timeout)
        return ranks[0]
    log = Path(log_dir or run_dir) / "linear_attention_cp.log"
    rc = run_logged(torchrun(CP) + [__file__, "--results-dir", run_dir, *args], log, timeout)
    assert rc == 0, f"the CP ranks {'timed out' if rc == 124 else f'exited {rc}'}; see {log}: {tail(log)}"
    return json.loads((run_dir / "rank0.json").read_text())


def cp_row(case, result):
    """A CP case's row from rank 0's judgement, or a FAIL with the error a rank met."""
    if result is None or result.get("error"):
        return row("single", case["name"], FAIL, (result or {}).get("error") or "no result from the CP ranks")
    return row("single", case["name"], result["status"], result["figure"], result["bound"], **result["detail"])


def _cp_case(case, device, rank, size, cache):
    """This rank's CP results for one case (float64 CPU tensors at its positions) and its positions."""
    dtype, kind = DTYPES[case["dtype"]], case["kind"]
    x, ids, _ = case_inputs(kind, device.type)
    positions = context_parallel_positions(ids.shape[1], ring_rank=rank, ring_size=size, layout="zigzag")
    shard = lambda t: t.index_select(1, positions)  # noqa: E731
    q, k, v, g, beta = _leaves([(n, shard(x[n])) for n in ("q", "k", "v", "g", "beta")], device, dtype)
    chunk = TRUTH_CHUNK if device.type == "cpu" else 64
    o = context_parallel_gated_delta(q, k, v, g, beta, group=None, layout="zigzag", document_ids=shard(ids).to(device),
                                     qk_l2norm=kind == "kda", chunk_size=chunk)
    (o.double() * shard(x["dout"]).to(device)).sum().backward()
    return dict(positions=positions, got=dict(zip(CP_TENSORS, map(_back, (o, q.grad, k.grad, v.grad, g.grad,
                                                                           beta.grad)))))


def _judge_cp(case, parts, device, cache):
    """Rank 0: the gathered CP tensors against float64 truth, "ref" the single-device rule with the same kernel."""
    order = torch.cat([p["positions"] for p in parts])
    full = {}
    for t in CP_TENSORS:
        cat = torch.cat([p["got"][t] for p in parts], dim=1)
        full[t] = torch.empty_like(cat).index_copy_(1, order, cat)
    kind, dtype = case["kind"], case["dtype"]
    if kind not in cache:
        cache[kind] = _cp_reference(kind, device.type, torch.device("cpu"), torch.float64, "torch", TRUTH_CHUNK)
    kernel = kernel_here(device, dtype, kind)
    chunk = TRUTH_CHUNK if device.type == "cpu" else 64
    ref = _cp_reference(kind, device.type, device, DTYPES[dtype], "auto", chunk)
    r = judged_row(case["name"], kernel, dtype, full, cache[kind], ref, sizes=SIZES[device.type], ranks=len(parts),
                   device=device.type)
    return dict(status=r["status"], figure=r["figure"], bound=r["bound"], detail=r["detail"])


def main():
    import torch.distributed as dist

    from tests.launch import worker_args, write_results

    args = worker_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    opts = parser.parse_args(args.extra)
    torch.set_float32_matmul_precision("highest")  # no TF32 in torch's products: fp32 rows mean fp32
    if opts.device == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    judged, cache = {}, {}
    for case in CP_CASES:
        try:
            mine = _cp_case(case, device, rank, size, cache)
        except Exception as e:  # alike on every rank (same inputs, same code)
            mine = dict(error=f"{type(e).__name__}: {e}"[:300])
        parts = [None] * size if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if rank == 0:
            errors = [p["error"] for p in parts if "error" in p]
            try:
                judged[case["name"]] = dict(error=errors[0]) if errors else _judge_cp(case, parts, device, cache)
            except Exception as e:
                judged[case["name"]] = dict(error=f"judging: {type(e).__name__}: {e}"[:300])
    write_results(args.results_dir, judged)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
