"""tools/gpu_check.py on the CPU: its simulated ring passes with the CPU kernels, it fails when
the ring is broken, and its exit status and final line say what ran and what did not."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from cp_ext.attention.masks import Band, Block

from tests.launch import REPO_ROOT

KERNELS, DTYPES = ("cpu", "unfused"), ("fp32", "bf16", "fp16")
DOC_TILES = ("diagonal causal", "diagonal full", "off-diagonal full", "one-row q docs full")


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; the machine is shared
    yield module
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_cpu_run_passes_every_kernel_dtype_and_mask(cpu_run):
    proc, summary = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["exit_status"] == 0 and summary["seconds"] > 0, summary  # the time is recorded, not bounded here
    rows = {r["check"]: r for r in summary["rows"]}
    for kernel in KERNELS:
        for dtype in DTYPES:
            for mask in ("causal", "full"):
                for heads in ("MHA 8/8", "GQA 8/2"):
                    name = f"sim-ring C4 s200 {kernel} {dtype} {mask} {heads}"
                    assert rows[name]["status"] == "PASS", rows.get(name)
                    assert set(rows[name]["detail"]["err"]) == {"out", "lse", "dq", "dk", "dv"}
    assert all(r["status"] == "PASS" for r in summary["rows"] if r["part"] == "single" and "sim-ring" in r["check"])
    for kernel in KERNELS:  # packed documents: forward_segments / backward_segments, and the ring with documents
        for dtype in DTYPES + ("fp64",):
            for tile, heads in [("diagonal causal", "MHA 8/8")] + [(t, "GQA 8/2") for t in DOC_TILES]:
                name = f"docs kernel {kernel} {dtype} {tile} {heads}"
                assert rows[name]["status"] == "PASS" and rows[name]["detail"]["segments"] > 0, rows.get(name)
            for mask in ("causal", "full"):
                name = f"docs sim-ring C4 s200 {kernel} {dtype} {mask} GQA 8/2"
                assert rows[name]["status"] == "PASS", rows.get(name)
                assert set(rows[name]["detail"]["err"]) == {"out", "lse", "dq", "dk", "dv"}
    assert {s["kernel"] for s in summary["skipped"]} == {"flash", "efficient", "cudnn", "flash_attn", "te"}
    for kernel in KERNELS:  # windows, sinks and MLA's head dims (tools/gpu_check_masks.py)
        for dtype in DTYPES + ("fp64",):
            for variant in ("window 24 + sink", "MLA 192/128 + sink", "MLA latent r64 + sink"):
                name = f"masks {variant} {kernel} {dtype}"
                assert rows[name]["status"] == "PASS", rows.get(name)
                grads = ("dlatent", "dweight") if "latent" in variant else ("dk", "dv")
                assert set(rows[name]["detail"]["err"]) == {"out", "dq", "doffset", *grads}
    env = summary["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and "date" in env


def test_cpu_run_says_multi_gpu_part_not_covered(gc, cpu_run):
    proc, summary = cpu_run
    multi = [r for r in summary["rows"] if r["part"] == "multi"]
    assert [r["check"] for r in multi] == list(gc.MULTI_GPU) and len(multi) == 4, multi
    assert all(r["status"] == "not covered" for r in multi), multi
    last = proc.stdout.strip().splitlines()[-2]
    assert last.startswith("gpu_check: PASSED") and "NOT covered" in last and "NCCL attention" in last, last


def _broken_merge(out, lse, block_out, block_lse, seq_slice=slice(None)):
    """A plain average instead of the LSE-weighted merge (the LSE itself is merged correctly)."""
    out[:, :, seq_slice].add_(0.5 * (block_out.to(out.dtype) - out[:, :, seq_slice]))
    lse[:, :, seq_slice].copy_(torch.logaddexp(lse[:, :, seq_slice], block_lse.to(lse.dtype)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_broken_merge_fails(gc, monkeypatch, dtype):
    monkeypatch.setattr(gc, "update_out_and_lse", _broken_merge)
    r = gc.sim_ring_row("cpu", dtype, True, True, torch.device("cpu"), {})
    assert r["status"] == "FAIL" and r["detail"]["err"]["out"] > r["detail"]["bounds"]["out"], r


def test_wrong_lse_in_backward_fails_only_the_gradients(gc, monkeypatch):
    """The backward recomputes P from the LSE it is given: a stale one (+0.05) breaks dq/dk/dv only."""
    kernel = gc.get_kernel(torch.device("cpu"), torch.float32, "unfused")

    class StaleLse:
        def forward_blocks(self, *a, **kw):
            return kernel.forward_blocks(*a, **kw)

        def backward_blocks(self, dout, q, k, v, out, lse, blocks, **kw):
            return kernel.backward_blocks(dout, q, k, v, out, lse + 0.05, blocks, **kw)

    monkeypatch.setattr(gc, "get_kernel", lambda *a, **kw: StaleLse())
    r = gc.sim_ring_row("unfused", "fp32", False, False, torch.device("cpu"), {})
    d = r["detail"]
    over = {t for t in d["err"] if d["err"][t] > d["bounds"][t]}
    assert r["status"] == "FAIL" and over == {"dq", "dk", "dv"}, d["err"]


def test_wrong_half_tile_fails(gc, monkeypatch):
    """A plan that computes the wrong half of the rows (zigzag's half tiles mirrored) is caught."""
    plan = gc.plan_tile

    def mirrored(q_runs, k_runs, window, *, same_tokens, **kw):
        blocks = plan(q_runs, k_runs, window, same_tokens=same_tokens, **kw)
        n = q_runs[-1][1]
        return blocks if same_tokens else [dataclasses.replace(b, q0=n - b.q1, q1=n - b.q0) for b in blocks]

    monkeypatch.setattr(gc, "plan_tile", mirrored)
    r = gc.sim_ring_row("cpu", "fp32", True, False, torch.device("cpu"), {})
    assert r["status"] == "FAIL", r


@pytest.mark.quick
def test_document_ids_and_truth(gc):
    """The ids hold single-token documents, padding and a document spanning the sequence; the
    per-document truth is attention under the dense block-diagonal (causal) mask, padding rows 0."""
    ids = gc.document_ids()
    lengths = [n for _, a, e in gc.document_runs(ids)[0] for n in [e - a]]
    assert ids.shape == (2, 200) and lengths.count(1) >= 3 and (ids[0, -6:] == -1).all() and ids[0, -7] >= 0
    assert (ids[1, 1:-2] == 1).all() and set(gc.DOC_TILES) == set(DOC_TILES)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.tensor([[0] * 5 + [1] + [2] * 10 + [3, 4] + [5] * 8 + [-1] * 4, [0] + [1] * 27 + [2] * 2])
    for causal in (True, False):
        got = gc.document_attention(q, k, v, dout, ids, ids, causal, torch.float64, "cpu")
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
        if causal:
            allowed &= torch.ones(30, 30, dtype=torch.bool).tril()
        scores = (xs[0] @ xs[1].repeat_interleave(2, 1).transpose(-1, -2) * 8 ** -0.5).masked_fill(
            ~allowed[:, None], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.where(lse.isfinite(), lse, 0).unsqueeze(-1))
        out = p @ xs[2].repeat_interleave(2, 1)
        out.backward(dout)
        want = dict(out=out.detach(), lse=lse.detach(), dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad)
        assert all(gc._max_err(got[t], want[t]) < 1e-12 for t in want), causal
        assert (got["out"][ids[:, None, :].expand(-1, 4, -1) < 0] == 0).all() and got["lse"][0, :, -1].isneginf().all()


def _wrong_blocks(kernel, how):
    """``kernel``'s class with ``how`` breaking the tiles it computes (document segments, as blocks):
    both ``forward_segments`` (a kernel tile) and the simulated ring's ``forward_blocks`` go through it."""

    class Wrong(type(kernel)):
        def forward_blocks(self, q, k, v, blocks, **kw):
            if how == "ignore documents":  # one block over the tile, causal where the segments were
                causal = any(b.band is not None for b in blocks) and q.shape[2] == k.shape[2]
                blocks = [Block(0, q.shape[2], 0, k.shape[2], Band(None, 0) if causal else None)]
            if how == "drop a segment":
                blocks = blocks[:-1]
            return super().forward_blocks(q, k, v, blocks, **kw)

        def backward_blocks(self, dout, q, k, v, out, lse, blocks, **kw):
            return super().backward_blocks(dout, q, k, v, out, lse + 0.05 if how == "stale lse" else lse, blocks, **kw)

    return Wrong()


@pytest.mark.parametrize("how, broken", [("ignore documents", {"out", "lse"}), ("drop a segment", {"out", "lse"}),
                                         ("stale lse", {"dq", "dk", "dv"})])
def test_wrong_document_kernel_fails(gc, monkeypatch, how, broken):
    get = gc.get_kernel
    monkeypatch.setattr(gc, "get_kernel", lambda *a, **kw: _wrong_blocks(get(*a, **kw), how))
    device = torch.device("cpu")
    for r in (gc.doc_kernel_row("cpu", "fp32", "diagonal causal", True, device, {}),
              gc.doc_sim_ring_row("cpu", "fp32", False, device, {})):
        d = r["detail"]
        over = {t for t in d["err"] if not d["err"][t] <= d["bounds"][t]}
        assert r["status"] == "FAIL" and broken <= over, (how, r["check"], d["err"])


def test_nan_is_a_failure(gc):
    t = {"out": float("nan")}
    assert gc.judge("single", "x", "fp32", t, {"out": 1e-6}, {"out": 1.0})["status"] == "FAIL"


def _row(gc, part, check, status):
    return gc.row(part, check, status)


def test_exit_status_and_final_line(gc):
    sim = _row(gc, "single", "sim-ring C4 s200 cpu fp32 causal MHA 8/8", "PASS")
    not_covered = [_row(gc, "multi", c, "not covered") for c in gc.MULTI_GPU]
    code, line = gc.verdict([sim] + not_covered)
    assert code == 0 and "PASSED" in line and "NOT covered" in line and gc.MULTI_GPU[1] in line, line
    code, line = gc.verdict([sim, _row(gc, "multi", "demo training --bf16: loss falls", "FAIL")] + not_covered[:1])
    assert code == 1 and line.startswith("gpu_check: FAILED: 1 of 2") and "demo training" in line, line
    assert gc.verdict(not_covered)[0] == 1  # the simulated ring must have run
    code, line = gc.verdict([sim, _row(gc, "multi", gc.MULTI_GPU[0], "PASS")])
    assert code == 0 and "NOT covered" not in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA preflight")
def test_no_cuda_exits_2(gc, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gc.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "CUDA is not usable" in capsys.readouterr().err


@pytest.mark.quick
@pytest.mark.parametrize("n", range(2, 9))
def test_demo_grid_is_valid_for_every_gpu_count(gc, n):
    from cp_ext.arguments import parse_args

    flags = [str(x) for x in gc.demo_flags(n)]
    args = parse_args(["--config", str(REPO_ROOT / "configs" / "cpu_demo.yaml"), "--device", "cpu", "--bf16",
                       "--train-iters", "30", *flags], world_size=n)
    assert args.context_parallel_size * args.data_parallel_size == n


def test_nccl_cases(gc):
    for n in range(2, 9):
        cases, missing = gc.nccl_cases(n)
        assert all(c["s"] % (2 * n) == 0 and 3800 <= c["s"] <= 4096 for c in cases)
        vias = {c["via"] for c in cases}
        assert ("hybrid" in vias) == (n >= 4 and n % 2 == 0) and ("ulysses" in vias) == (8 % n == 0), (n, vias)
        assert len(missing) == 2 - len(vias - {"ring"})


# ---------------------------------------------------------------- the multi-GPU rows' reading, on fake results
def _fake_run(monkeypatch, gc, write):
    """Replace the subprocess: ``write(out)`` plays the run's output files; the run 'exits 0'."""
    def run(cmd, log, timeout):
        log.write_text("fake run\n")
        write(log.parent)
        return 0
    monkeypatch.setattr(gc, "run_logged", run)


@pytest.mark.parametrize("loss, status", [
    ([5.5 - 0.1 * i for i in range(30)], "PASS"),
    ([4.0 + 0.01 * i for i in range(30)], "FAIL"),  # rises
    ([5.5] * 29 + [float("nan")], "FAIL"),  # not finite
    ([5.5 - 0.1 * i for i in range(20)], "FAIL"),  # stopped early
    (None, "FAIL"),  # wrote nothing: the stale file from an earlier run must not count
])
def test_demo_row(gc, monkeypatch, tmp_path, loss, status):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_text('{"iteration": 1, "train/lm_loss": 9.0}\n' * 30)  # stale
    if loss is None:
        _fake_run(monkeypatch, gc, lambda out: None)
    else:
        _fake_run(monkeypatch, gc, lambda out: (out / "demo" / "metrics.jsonl").write_text(
            "".join(json.dumps({"iteration": i + 1, "train/lm_loss": x}) + "\n" for i, x in enumerate(loss))))
    assert gc.demo_row(tmp_path, 4, 10)["status"] == status


def _bench_json(n, off_by=0):
    from cp_ext.perf.comm import cp_attention_bytes

    s = 2 * n * (4096 // n)
    counted = {}
    for variant, u in {"ring": 1, "ulysses": n, "hybrid": 2}.items():
        f = cp_attention_bytes(b=1, h=8, hk=2, s=s, d=64, cp=n, ulysses=u, dtype="bf16")
        counted[variant] = {c: {"fwd": f[c]["fwd"] + off_by, "bwd": f[c]["bwd"], "formula_fwd": f[c]["fwd"] + off_by,
                                "formula_bwd": f[c]["bwd"]} for c in ("ring_p2p", "ulysses_a2a") if f[c]["fwd"]}
    return json.dumps({"bytes": counted, "bytes_match": True, "variants": {}})


@pytest.mark.parametrize("off_by, status", [(0, "PASS"), (2, "FAIL")])
def test_bench_row_recomputes_the_formula(gc, monkeypatch, tmp_path, off_by, status):
    """Counted == the bench's formula is not enough: the formula is recomputed from cp_ext.perf.comm."""
    _fake_run(monkeypatch, gc, lambda out: (out / "bench.json").write_text(_bench_json(4, off_by)))
    r = gc.bench_row(tmp_path, 4, 10)
    assert r["status"] == status and r["figure"] == f"{4 - (off_by > 0) * 4}/4 collectives match", r


def test_nccl_rows(gc, monkeypatch, tmp_path):
    cases, _ = gc.nccl_cases(2)
    tensors = ("out", "dq", "dk", "dv")

    def rank(bad=None):
        res = {}
        for c in cases:
            err = 0.5e-5 if c["dtype"] == "fp32" else 1e-2
            res[c["name"]] = {"err": {t: 3.0 if c["name"] == bad else err for t in tensors},
                              "ref_err": {t: err for t in tensors}, "max_truth": {t: 3.0 for t in tensors},
                              "dtypes_ok": True}
        return res

    bad = cases[1]["name"]
    _fake_run(monkeypatch, gc, lambda out: (out / "attention.json").write_text(json.dumps([rank(), rank(bad)])))
    rows = gc.nccl_attention_rows(tmp_path, 2, 10)
    status = {r["check"]: r["status"] for r in rows}
    assert [k for k, v in status.items() if v == "FAIL"] == [bad]
    assert sum(v == "PASS" for v in status.values()) == len(cases) - 1
    assert [k for k, v in status.items() if v == "not covered"] == ["NCCL hybrid U2 x R1: needs an even number >= 4 "
                                                                     "of GPUs, not 2"]
    _fake_run(monkeypatch, gc, lambda out: None)  # the worker "exited 0" but wrote nothing
    assert [r["status"] for r in gc.nccl_attention_rows(tmp_path, 2, 10)] == ["FAIL"]


def test_family_rows_pass_a_real_run_and_fail_a_broken_one(gc, tmp_path):
    """gpu_check's family rows on a real (CPU) run of one script's flags: PASS with 3 finite losses; a run
    that cannot start (an unknown flag) is a FAIL row with its exit status, never a pass."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from gpu_check_families import family_rows

    def on_cpu(cmd, log, timeout):
        return gc.run_logged([("cpu" if str(c) == "cuda" else c) for c in cmd], log, timeout)

    (ok,) = family_rows(tmp_path, 120, on_cpu, gc.row, families=["mixtral_8x7b"])
    assert ok["status"] == "PASS", ok

    def broken(cmd, log, timeout):
        return gc.run_logged([*cmd, "--no-such-flag"], log, timeout)

    (bad,) = family_rows(tmp_path, 120, broken, gc.row, families=["qwen3_30b_a3b"])
    assert bad["status"] == "FAIL" and "exit 2" in bad["figure"], bad
