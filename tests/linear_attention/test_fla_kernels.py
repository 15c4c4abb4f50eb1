"""cp_ext.linear_attention.fla_kernels on the CPU: the ``kernel`` dispatch, the [0 | I] widening through the rule's
public ``initial_state``, and everything the fla path does around fla's op, run against a stand-in op.

The stand-in computes what fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` document (inputs [B, T, H, ...]; with
``cu_seqlens``, B == 1 and each listed sequence runs from its own ``initial_state[n]``; a final state per
sequence) with the torch rule, sequence by sequence, in float64. So the fla path's flattening, its cuts at
document starts, the initial state each sequence gets, the final state it picks per row, its head repeat and
its widening are checked exactly (1e-10) here; fla's own numbers only on a GPU (test at the end, and
tests/gpu/test_linear_attention.py in the GPU check).
"""

import pytest
import torch

from cp_ext.linear_attention import fla_kernels, gated_delta_rule, segment_summary
from tests.linear_attention.reference import documents, inputs, max_err

EXACT = 1e-10
RULE_ARGS = ("q", "k", "v", "g", "beta")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy sizes: more threads only contend
    yield
    torch.set_num_threads(threads)


def _case(per_channel, b=2, s=37, hk=1, hv=2, kd=8, vd=6, seed=3):
    """float64 rule inputs with packed documents (row 0: starts inside, and, with ``previous``, at its first token)."""
    x = inputs(b, s, hk, hv, kd, vd, seed=seed, per_channel=per_channel)
    return [x[n] for n in RULE_ARGS], documents(b, s, 9)


def _previous(ids):
    """Row 0's first token starts a document (the id before it differs); row 1 continues its state."""
    return torch.stack([ids[0, 0] - 1, ids[1, 0]])


# ---------------------------------------------------------------- the dispatch
@pytest.mark.quick
def test_dispatch_picks_torch_on_the_cpu_and_never_imports_fla(monkeypatch):
    def no_import(per_channel):
        raise AssertionError("a CPU call must not import fla")

    monkeypatch.setattr(fla_kernels, "_import", no_import)
    args, ids = _case(per_channel=False)
    q, k, v, g, _ = args
    assert not fla_kernels.use_fla("auto", q, k, v, g) and not fla_kernels.use_fla("torch", q, k, v, g)
    with pytest.raises(ValueError, match="kernel='fla' cannot run this call: fla's kernels run on CUDA tensors only"):
        fla_kernels.use_fla("fla", q, k, v, g)
    with pytest.raises(ValueError, match="kernel is one of"):
        fla_kernels.use_fla("triton", q, k, v, g)
    with pytest.raises(ValueError, match="kernel='fla'"):
        segment_summary(*args, kernel="fla")
    # "auto" on the CPU is the torch rule, bit for bit
    for fn in (gated_delta_rule, segment_summary):
        auto = fn(*args, document_ids=ids, chunk_size=8)
        plain = fn(*args, document_ids=ids, chunk_size=8, kernel="torch")
        assert all(torch.equal(a, p) for a, p in zip(auto, plain)), fn.__name__


@pytest.mark.quick
def test_what_fla_can_run(monkeypatch):
    """fla_problem on a CUDA call, with fla importable or not (faked: no GPU here)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(fla_kernels, "_import", lambda per_channel: (None, f"no fla ({per_channel})"))
    assert fla_kernels.fla_problem("cuda", (bf16,) * 3, 128, True) == "no fla (True)"
    monkeypatch.setattr(fla_kernels, "_import", lambda per_channel: (object(), None))
    assert fla_kernels.fla_problem("cuda", (bf16,) * 3, 128, False) is None
    assert fla_kernels.fla_problem("cuda", (fp32,) * 3, 256, True) is None
    assert "float64" in fla_kernels.fla_problem("cuda", (torch.float64,) * 3, 128, False)
    assert "one dtype" in fla_kernels.fla_problem("cuda", (bf16, bf16, fp32), 128, False)
    assert "at most 256" in fla_kernels.fla_problem("cuda", (bf16,) * 3, 512, False)
    assert "CUDA tensors only" in fla_kernels.fla_problem("cpu", (bf16,) * 3, 128, False)


def test_an_import_failure_is_a_reason_that_names_the_package(monkeypatch):
    """Whatever stops the import (not installed, no Triton, a GPU probe at import) is the reason, with the fix."""
    def fail(name):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(fla_kernels.importlib, "import_module", fail)
    fla_kernels._import.cache_clear()
    try:
        op, why = fla_kernels._import(True)
    finally:
        fla_kernels._import.cache_clear()
    assert op is None and "chunk_kda" in why and "No module named 'fla'" in why, why
    assert "pip install flash-linear-attention" in why, why


# ---------------------------------------------------------------- the widening, through the rule's public initial_state
@pytest.mark.quick
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_identity_block_gives_the_summary(per_channel):
    """The rule on v widened by K zero columns from [0 | I] is the summary (o0 | Qtilde, E | M), and the
    summary is the rule's affine map: any S_in gives o = o0 + Qtilde S_in and S_out = M S_in + E. float64."""
    args, ids = _case(per_channel)
    q, k, v, g, beta = args
    b, s, hv, vd = v.shape
    kd = k.shape[-1]
    prev = _previous(ids)
    widened = torch.cat([v, v.new_zeros(b, s, hv, kd)], dim=-1)
    start = torch.cat([v.new_zeros(b, hv, kd, vd), torch.eye(kd, dtype=v.dtype).expand(b, hv, kd, kd)], dim=-1)
    o, final = gated_delta_rule(q, k, widened, g, beta, initial_state=start, document_ids=ids,
                                previous_document_id=prev, chunk_size=8)
    summary = segment_summary(*args, document_ids=ids, previous_document_id=prev, chunk_size=16)
    assert max_err(o[..., :vd], summary.o0) < EXACT and max_err(o[..., vd:], summary.qtilde) < EXACT
    assert max_err(final[..., :vd], summary.contribution) < EXACT
    assert max_err(final[..., vd:], summary.transition) < EXACT
    assert (summary.transition == 0).all()  # both rows have a document start inside: nothing before it passes
    assert (summary.qtilde[0] == 0).all()  # row 0 resets at its first token: no output reads the state before

    # one document of 12 tokens (the decay keeps M well away from 0): the rule from a random state
    args, ids = [x[:, :12] for x in args], torch.zeros(b, 12, dtype=torch.int64)
    summary = segment_summary(*args, document_ids=ids, chunk_size=16)
    state_in = torch.randn(b, hv, kd, vd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    o, final = gated_delta_rule(*args, initial_state=state_in, document_ids=ids, chunk_size=8)
    assert summary.transition.abs().max() > 1e-2
    assert max_err(o, summary.o0 + torch.einsum("bshk,bhkv->bshv", summary.qtilde, state_in)) < EXACT
    assert max_err(final, summary.transition @ state_in + summary.contribution) < EXACT


# ---------------------------------------------------------------- the fla path around a stand-in for fla's op
def _stand_in(calls, broken=None):
    """fla's chunked op as documented (module docstring), by the torch rule; records each call. ``broken``:
    "no initial state" (every sequence from zeros) or "weaker decay" (g x 0.9), for the GPU rows' own test."""

    def op(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        initial_state = None if broken == "no initial state" else initial_state
        g = 0.9 * g if broken == "weaker decay" else g
        calls.append(dict(cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(), heads=q.shape[2],
                          initial=None if initial_state is None else initial_state.detach().clone(), scale=scale))
        assert q.shape[2] == k.shape[2] == v.shape[2], "the fla path repeats grouped q/k heads itself"
        if cu_seqlens is None:
            spans = [(row, 0, q.shape[1]) for row in range(q.shape[0])]
        else:
            assert q.shape[0] == 1, "fla takes one flat row with cu_seqlens"
            bounds = cu_seqlens.tolist()
            spans = [(0, a, e) for a, e in zip(bounds[:-1], bounds[1:])]
        outs, finals = [], []
        for n, (row, a, e) in enumerate(spans):
            part = [x[row:row + 1, a:e] for x in (q, k, v, g, beta)]
            state = None if initial_state is None else initial_state[n:n + 1]
            o, final = gated_delta_rule(*part, initial_state=state, scale=scale, qk_l2norm=use_qk_l2norm_in_kernel,
                                        chunk_size=8, kernel="torch")
            outs.append(o)
            finals.append(final)
        return torch.cat(outs, dim=0 if cu_seqlens is None else 1), torch.cat(finals) if output_final_state else None

    return op


@pytest.fixture
def stand_in(monkeypatch):
    """Route kernel="fla" to the stand-in on the CPU: every call it receives is in the returned list."""
    calls = []
    monkeypatch.setattr(fla_kernels, "fla_problem", lambda *a: None)
    monkeypatch.setattr(fla_kernels, "_import", lambda per_channel: (_stand_in(calls), None))
    return calls


def _grads(fn, args, extra=()):
    """The outputs of fn(*args, *extra) and every input's gradient of a fixed random functional of them."""
    leaves = [x.detach().clone().requires_grad_() for x in [*args, *extra]]
    outs = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [leaf.grad for leaf in leaves]


@pytest.mark.quick
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_fla_rule_path_equals_the_torch_rule(stand_in, per_channel):
    """Documents (a start inside each row, row 0 also at its first token), an initial state, grouped value
    heads, qk_l2norm and a scale: o, the final state and every gradient (initial state included), float64."""
    args, ids = _case(per_channel)
    prev = _previous(ids)
    b, _, hv, vd = args[2].shape
    kd = args[0].shape[-1]
    state = torch.randn(b, hv, kd, vd, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def rule(kernel):
        return lambda q, k, v, g, beta, h0: gated_delta_rule(q, k, v, g, beta, initial_state=h0, document_ids=ids,
                                                             previous_document_id=prev, scale=0.3, qk_l2norm=True,
                                                             chunk_size=8, kernel=kernel)

    got, want = _grads(rule("fla"), args, [state]), _grads(rule("torch"), args, [state])
    assert all(max_err(a, w) < EXACT for a, w in zip(got, want)), [max_err(a, w) for a, w in zip(got, want)]
    (call,) = stand_in
    starts = [0, 9, 12, 13, 27, 28, 37, 37 + 20]  # row 0's document starts (documents(..., 9)), then row 1's two
    assert call["cu_seqlens"] == starts + [74] and call["heads"] == hv and call["scale"] == 0.3
    # each sequence's initial state: row 0 starts a document at its first token (zeros), row 1 continues its state
    first_of_row = {0: 0, len(starts) - 2: 1}
    for n, initial in enumerate(call["initial"]):
        assert torch.equal(initial, state[1] if first_of_row.get(n) == 1 else torch.zeros_like(initial)), n

    stand_in.clear()  # without documents: fla's batch as it is, no cuts
    plain = lambda kernel: lambda *xs: gated_delta_rule(*xs[:5], initial_state=xs[5], kernel=kernel)  # noqa: E731
    got, want = _grads(plain("fla"), args, [state]), _grads(plain("torch"), args, [state])
    assert all(max_err(a, w) < EXACT for a, w in zip(got, want))
    assert stand_in[0]["cu_seqlens"] is None and stand_in[0]["scale"] == kd ** -0.5
    assert torch.equal(stand_in[0]["initial"], state)


@pytest.mark.quick
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_fla_summary_path_equals_the_torch_summary(stand_in, per_channel):
    """o0, Qtilde, M, E and every input's gradient through them, with and without documents, float64; the
    one call gets [0 | I] for each row's first sequence and zeros after each document start."""
    args, ids = _case(per_channel, b=3, s=21)  # row 2: one short document, so its M is well away from 0
    prev = torch.stack([ids[0, 0] - 1, ids[1, 0], ids[2, 0]])
    kd, vd = args[0].shape[-1], args[2].shape[-1]
    for document_ids, previous in ((ids, prev), (None, None)):
        stand_in.clear()

        def summary(kernel):
            return lambda *xs: segment_summary(*xs, document_ids=document_ids, previous_document_id=previous,
                                               chunk_size=8, kernel=kernel)

        got, want = _grads(summary("fla"), args), _grads(summary("torch"), args)
        assert all(a.dtype == torch.float64 for a in got[:4])
        assert all(max_err(a, w) < EXACT for a, w in zip(got, want)), [max_err(a, w) for a, w in zip(got, want)]
        scale = want[2][2].abs().max()  # row 2's M: small (decays and delta-rule contractions), not zero
        assert scale > 0 and max_err(got[2], want[2]) <= 1e-9 * scale
        (call,) = stand_in
        identity = torch.cat([torch.zeros(kd, vd, dtype=torch.float64), torch.eye(kd, dtype=torch.float64)], dim=-1)
        if document_ids is None:
            assert call["cu_seqlens"] is None and all(torch.equal(x, identity) for x in call["initial"].flatten(0, 1))
            continue
        firsts = [0, 4, 4 + 2]  # the first sequence of each row: row 0 has 4 sequences, row 1 two
        for n, initial in enumerate(call["initial"]):
            want_initial = identity if n in firsts[1:] else torch.zeros_like(identity)  # row 0 resets at token 0
            assert all(torch.equal(x, want_initial) for x in initial), n


# ---------------------------------------------------------------- the GPU check's fla rows, judged on the CPU
@pytest.mark.parametrize("broken", [None, "no initial state", "weaker decay"])
def test_the_gpu_checks_fla_rows_pass_the_stand_in_and_fail_a_wrong_op(monkeypatch, broken):
    """tests/gpu/linear_attention.py's fla rows (their inputs, truth, measure and bounds, at its CPU sizes) with the
    stand-in for fla: all PASS; an op that drops the initial states or weakens the decay fails every row."""
    from tests.gpu.linear_attention import DTYPES, KINDS, fla_rows

    monkeypatch.setattr(fla_kernels, "fla_problem", lambda *a: None)
    monkeypatch.setattr(fla_kernels, "_import", lambda per_channel: (_stand_in([], broken), None))
    budget = type("Budget", (), {"left": lambda self, cap: cap})()
    rows = fla_rows(torch.device("cpu"), budget, {})
    assert len(rows) == 2 * len(KINDS) * len(DTYPES)
    status = {r["check"]: r["status"] for r in rows}
    assert set(status.values()) == ({"PASS"} if broken is None else {"FAIL"}), status
    if broken is None:
        assert all(r["detail"]["kernel"] == "fla" and set(r["detail"]["err"]) for r in rows)


# ---------------------------------------------------------------- fla itself (CUDA and fla only)
def _fla_missing():
    if not torch.cuda.is_available():
        return "needs CUDA (fla's kernels are Triton, GPU only)"
    return fla_kernels.fla_problem("cuda", (torch.float32,) * 3, 64, False)


@pytest.mark.skipif(_fla_missing() is not None, reason=str(_fla_missing()))
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_fla_on_cuda_matches_the_torch_rule(per_channel):
    """fp32 on the GPU, documents and grouped heads: fla's o, final state and summary within fla's own test
    tolerance (rms error / rms <= 0.005) of the torch rule; tools/gpu_check.sh has the full rows."""
    args, ids = _case(per_channel, s=200, kd=64, vd=64)
    args, ids = [x.cuda().float() for x in args], ids.cuda()
    rms = lambda a, w: ((a.double() - w.double()).norm() / w.double().norm()).item()  # noqa: E731
    for fn in (gated_delta_rule, segment_summary):
        got, want = fn(*args, document_ids=ids, kernel="fla"), fn(*args, document_ids=ids, kernel="torch")
        assert all(rms(a, w) <= 0.005 for a, w in zip(got, want) if w.abs().max() > 0), fn.__name__
