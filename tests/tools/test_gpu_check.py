"""tools/gpu_check.py on the CPU and the GPU check's tests (tests/gpu): the CPU run passes with the CPU
kernels, the ring and the document kernels fail when broken, and the exit status and final line say
what ran and what did not."""

import contextlib
import dataclasses
import json
import sys
from unittest import mock

import pytest
import torch

from cp_ext.attention.masks.tiles import Band, Block
from tests.gpu import multi_gpu, runs
from tests.gpu.one_device import DOC_TILES as DOC_TILE_SPECS, doc_kernel_row, document_attention, document_ids, max_err
from tests.gpu.ring_harness import ring_case, ring_row, run_ring_cases
from tests.gpu.rows import FAIL, MULTI_GPU, judge, row, verdict
from tests.launch import REPO_ROOT, run_script, start_script

TOOL = REPO_ROOT / "tools" / "gpu_check.py"
KERNELS, DTYPES = ("cpu", "unfused"), ("fp32", "bf16", "fp16")
DOC_TILES = ("diagonal causal", "diagonal full", "off-diagonal full", "one-row q docs full")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; the machine is shared
    yield
    torch.set_num_threads(threads)


def _tool(*args, timeout=300):
    return run_script(0, TOOL, *map(str, args), check=False, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _cpu_run_started(request, tmp_path_factory):
    """The CPU run starts with the module's first test, and the tests that read it are at the end of this
    file: much of the run is one process (pytest, imports), so the rest of the module runs beside it."""
    started = {}
    if any(item.module is request.module and "cpu_run" in item.fixturenames for item in request.session.items):
        started["out"] = tmp_path_factory.mktemp("gpu_check")
        started["run"] = start_script(0, TOOL, "--device", "cpu", "--out", started["out"])
    yield started
    if "run" in started and started["run"].poll() is None:
        started["run"].kill()


@pytest.fixture(scope="module")
def cpu_run(_cpu_run_started):
    proc, out = _cpu_run_started["run"].finish(300), _cpu_run_started["out"]
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_a_failed_check_fails_the_run(tmp_path):
    """Past its budget every check that runs is a FAIL ("not run: time budget spent"): exit 1."""
    proc = _tool("--device", "cpu", "--budget", "0", "--out", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    last = proc.stdout.strip().splitlines()[-2]
    assert proc.returncode == 1 == summary["exit_status"] and last.startswith("gpu_check: FAILED: "), last
    ring = [r for r in summary["rows"] if r["check"].startswith("sim-ring")]
    assert ring and all(r["status"] == "FAIL" and r["figure"] == "not run: time budget spent" for r in ring), ring


# ---------------------------------------------------------------- broken rings and kernels must fail
def _broken_merge(out, lse, block_out, block_lse, seq_slice=slice(None)):
    """A plain average instead of the LSE-weighted merge (the LSE itself is merged correctly)."""
    out[:, :, seq_slice].add_(0.5 * (block_out.to(out.dtype) - out[:, :, seq_slice]))
    lse[:, :, seq_slice].copy_(torch.logaddexp(lse[:, :, seq_slice], block_lse.to(lse.dtype)))


@contextlib.contextmanager
def broken_merge(kernel, report):
    with mock.patch("cp_ext.attention.cp.ring.update_out_and_lse", _broken_merge):
        yield kernel


@contextlib.contextmanager
def mirrored_half_tiles(kernel, report):
    """A plan that computes the wrong half of the rows (zigzag's half tiles mirrored)."""
    from cp_ext.attention.masks.tiles import plan_tile

    def mirrored(q_runs, k_runs, window, *, same_tokens, **kw):
        blocks = plan_tile(q_runs, k_runs, window, same_tokens=same_tokens, **kw)
        n = q_runs[-1][1]
        return blocks if same_tokens else [dataclasses.replace(b, q0=n - b.q1, q1=n - b.q0) for b in blocks]

    with mock.patch("cp_ext.attention.cp.ring.plan_tile", mirrored):
        yield kernel


def _wrong_blocks(kernel, how):
    """``kernel``'s class with ``how`` breaking the tiles it computes (document segments, as blocks):
    both ``forward_segments`` (a kernel tile) and the ring's ``forward_blocks`` go through it."""

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


def _wrong_blocks_hook(how):
    @contextlib.contextmanager
    def hook(kernel, report):
        yield _wrong_blocks(kernel, how)
    return hook


ignore_documents, drop_a_segment, stale_lse = map(_wrong_blocks_hook, ("ignore documents", "drop a segment",
                                                                        "stale lse"))
HOOK = {"ignore documents": "ignore_documents", "drop a segment": "drop_a_segment", "stale lse": "stale_lse"}
BROKEN = [ring_case("broken merge fp32", "cpu", "fp32", True, True, hook=f"{__name__}:broken_merge"),
          ring_case("broken merge bf16", "cpu", "bf16", True, True, hook=f"{__name__}:broken_merge"),
          ring_case("stale lse", "unfused", "fp32", False, False, hook=f"{__name__}:stale_lse"),
          ring_case("mirrored half tiles", "cpu", "fp32", True, False, hook=f"{__name__}:mirrored_half_tiles")]
BROKEN += [ring_case(f"docs {how}", "cpu", "fp32", False, True, docs=True, hook=f"{__name__}:{name}")
           for how, name in HOOK.items()]


@pytest.fixture(scope="module")
def broken():
    """Every broken case through the library's ring on 4 CPU ranks, in one launch: {name: its row}."""
    results = run_ring_cases(BROKEN, torch.device("cpu"), timeout=300)
    return {c["name"]: ring_row(c["name"], c["dtype"], results[c["name"]]) for c in BROKEN}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_broken_merge_fails(broken, dtype):
    r = broken[f"broken merge {dtype}"]
    assert r["status"] == "FAIL" and r["detail"]["err"]["out"] > r["detail"]["bounds"]["out"], r


def test_wrong_lse_in_backward_fails_only_the_gradients(broken):
    """The backward recomputes P from the LSE it is given: a stale one (+0.05) breaks dq/dk/dv only."""
    d = broken["stale lse"]["detail"]
    over = {t for t in d["err"] if d["err"][t] > d["bounds"][t]}
    assert broken["stale lse"]["status"] == "FAIL" and over == {"dq", "dk", "dv"}, d["err"]


def test_wrong_half_tile_fails(broken):
    assert broken["mirrored half tiles"]["status"] == "FAIL", broken["mirrored half tiles"]


@pytest.mark.parametrize("how, wrong", [("ignore documents", {"out", "lse"}), ("drop a segment", {"out", "lse"}),
                                        ("stale lse", {"dq", "dk", "dv"})])
def test_wrong_document_kernel_fails(broken, monkeypatch, how, wrong):
    import tests.gpu.one_device as one_device

    get = one_device.get_kernel
    monkeypatch.setattr(one_device, "get_kernel", lambda *a, **kw: _wrong_blocks(get(*a, **kw), how))
    kernel_row = doc_kernel_row("cpu", "fp32", "diagonal causal", True, torch.device("cpu"), {})
    for r in (kernel_row, broken[f"docs {how}"]):
        d = r["detail"]
        over = {t for t in d["err"] if not d["err"][t] <= d["bounds"][t]}
        assert r["status"] == "FAIL" and wrong <= over, (how, r["check"], d["err"])


@pytest.mark.quick
def test_document_ids_and_truth():
    """The ids hold single-token documents, padding and a document spanning the sequence; the
    per-document truth is attention under the dense block-diagonal (causal) mask, padding rows 0."""
    from cp_ext.attention.masks.documents import document_runs

    ids = document_ids()
    lengths = [n for _, a, e in document_runs(ids)[0] for n in [e - a]]
    assert ids.shape == (2, 200) and lengths.count(1) >= 3 and (ids[0, -6:] == -1).all() and ids[0, -7] >= 0
    assert (ids[1, 1:-2] == 1).all() and set(DOC_TILE_SPECS) == set(DOC_TILES)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.tensor([[0] * 5 + [1] + [2] * 10 + [3, 4] + [5] * 8 + [-1] * 4, [0] + [1] * 27 + [2] * 2])
    for causal in (True, False):
        got = document_attention(q, k, v, dout, ids, ids, causal, torch.float64, "cpu")
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
        assert all(max_err(got[t], want[t]) < 1e-12 for t in want), causal
        assert (got["out"][ids[:, None, :].expand(-1, 4, -1) < 0] == 0).all() and got["lse"][0, :, -1].isneginf().all()


def test_nan_is_a_failure():
    t = {"out": float("nan")}
    assert judge("single", "x", "fp32", t, {"out": 1e-6}, {"out": 1.0})["status"] == "FAIL"


def test_exit_status_and_final_line():
    sim = row("single", "sim-ring C4 s200 cpu fp32 causal MHA 8/8", "PASS")
    not_covered = [row("multi", c, "not covered") for c in MULTI_GPU]
    code, line = verdict([sim] + not_covered)
    assert code == 0 and "PASSED" in line and "NOT covered" in line and MULTI_GPU[1] in line, line
    code, line = verdict([sim, row("multi", "demo training --bf16: loss falls", "FAIL")] + not_covered[:1])
    assert code == 1 and line.startswith("gpu_check: FAILED: 1 of 2") and "demo training" in line, line
    assert verdict(not_covered)[0] == 1  # the ring on one device must have run
    code, line = verdict([sim, row("multi", MULTI_GPU[0], "PASS")])
    assert code == 0 and "NOT covered" not in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA preflight")
def test_no_cuda_exits_2(tmp_path):
    proc = _tool("--out", tmp_path)
    assert proc.returncode == 2 and "CUDA is not usable" in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------- the multi-GPU rows' reading, on fake results
@pytest.mark.quick
@pytest.mark.parametrize("n", range(2, 9))
def test_demo_grid_is_valid_for_every_gpu_count(n):
    from cp_ext.arguments import parse_args

    flags = [str(x) for x in multi_gpu.demo_flags(n)]
    args = parse_args(["--config", str(REPO_ROOT / "configs" / "cpu_demo.yaml"), "--device", "cpu", "--bf16",
                       "--train-iters", "30", *flags], world_size=n)
    assert args.context_parallel_size * args.data_parallel_size == n


def test_nccl_cases():
    for n in range(2, 9):
        cases, missing = multi_gpu.nccl_cases(n)
        assert all(c["s"] % (2 * n) == 0 and 3800 <= c["s"] <= 4096 for c in cases)
        vias = {c["via"] for c in cases}
        assert ("hybrid" in vias) == (n >= 4 and n % 2 == 0) and ("ulysses" in vias) == (8 % n == 0), (n, vias)
        assert len(missing) == 2 - len(vias - {"ring"})


def _fake_run(monkeypatch, write):
    """Replace the subprocess: ``write(out)`` plays the run's output files; the run 'exits 0'."""
    def run(cmd, log, timeout):
        log.write_text("fake run\n")
        write(log.parent)
        return 0
    monkeypatch.setattr(runs, "run_logged", run)


@pytest.mark.parametrize("loss, status", [
    ([5.5 - 0.1 * i for i in range(30)], "PASS"),
    ([4.0 + 0.01 * i for i in range(30)], "FAIL"),  # rises
    ([5.5] * 29 + [float("nan")], "FAIL"),  # not finite
    ([5.5 - 0.1 * i for i in range(20)], "FAIL"),  # stopped early
    (None, "FAIL"),  # wrote nothing: the stale file from an earlier run must not count
])
def test_demo_row(monkeypatch, tmp_path, loss, status):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_text('{"iteration": 1, "train/lm_loss": 9.0}\n' * 30)  # stale
    if loss is None:
        _fake_run(monkeypatch, lambda out: None)
    else:
        _fake_run(monkeypatch, lambda out: (out / "demo" / "metrics.jsonl").write_text(
            "".join(json.dumps({"iteration": i + 1, "train/lm_loss": x}) + "\n" for i, x in enumerate(loss))))
    assert multi_gpu.demo_row(tmp_path, 4, 10)["status"] == status


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
def test_bench_row_recomputes_the_formula(monkeypatch, tmp_path, off_by, status):
    """Counted == the bench's formula is not enough: the formula is recomputed from cp_ext.perf.comm."""
    _fake_run(monkeypatch, lambda out: (out / "bench.json").write_text(_bench_json(4, off_by)))
    r = multi_gpu.bench_row(tmp_path, 4, 10)
    assert r["status"] == status and r["figure"] == f"{4 - (off_by > 0) * 4}/4 collectives match", r


def test_nccl_rows(monkeypatch, tmp_path):
    cases, _ = multi_gpu.nccl_cases(2)
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
    _fake_run(monkeypatch, lambda out: (out / "attention.json").write_text(json.dumps([rank(), rank(bad)])))
    rows = multi_gpu.nccl_attention_rows(tmp_path, 2, 10)
    status = {r["check"]: r["status"] for r in rows}
    assert [k for k, v in status.items() if v == "FAIL"] == [bad]
    assert sum(v == "PASS" for v in status.values()) == len(cases) - 1
    assert [k for k, v in status.items() if v == "not covered"] == ["NCCL hybrid U2 x R1: needs an even number >= 4 "
                                                                     "of GPUs, not 2"]
    _fake_run(monkeypatch, lambda out: None)  # the worker "exited 0" but wrote nothing
    assert [r["status"] for r in multi_gpu.nccl_attention_rows(tmp_path, 2, 10)] == ["FAIL"]


def test_run_logged_keeps_the_output_and_stops_a_run_past_its_time(tmp_path):
    code = "import sys, time; print('started', flush=True); time.sleep(int(sys.argv[1])); sys.exit(3)"
    assert runs.run_logged([sys.executable, "-c", code, 0], tmp_path / "quick.log", 60) == 3
    assert (tmp_path / "quick.log").read_text() == "started\n"
    assert runs.run_logged([sys.executable, "-c", code, 600], tmp_path / "slow.log", 1) == 124  # killed, not 3
    assert (tmp_path / "slow.log").read_text() == "started\n"


def _forked(cmd, log, timeout):
    """`runs.run_logged` for ``python script args``, forked from the suite's pre-imported server."""
    proc = run_script(0, REPO_ROOT / cmd[1], *map(str, cmd[2:]), check=False, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode


def test_family_rows_pass_a_real_run_and_fail_a_broken_one(monkeypatch, tmp_path):
    """The family rows on a real (CPU) run of one script's flags: PASS with 3 finite losses; a run that
    cannot start (an unknown flag) is a FAIL row with its exit status, never a pass."""
    monkeypatch.setattr(runs, "run_logged", _forked)
    ok = runs.family_row("mixtral_8x7b", tmp_path, 120, device="cpu")
    assert ok["status"] == "PASS", ok
    bad = runs.family_row("qwen3_30b_a3b", tmp_path, 120, device="cpu", extra=["--no-such-flag"])
    assert bad["status"] == FAIL and "exit 2" in bad["figure"], bad


def test_async_save_row_passes_a_real_run_and_fails_a_broken_one(monkeypatch, tmp_path):
    """The async-save row on real (CPU) runs: PASS when both runs publish every checkpoint with the same tensors;
    a run that cannot start is a FAIL row, never a pass."""
    monkeypatch.setattr(runs, "run_logged", _forked)
    ok = runs.async_save_row(tmp_path / "ok", 240, device="cpu")
    assert ok["status"] == "PASS" and ok["figure"].endswith("losses 0.0e+00 apart"), ok
    bad = runs.async_save_row(tmp_path / "bad", 240, device="cpu", extra=["--no-such-flag"])
    assert bad["status"] == FAIL and "exit 2" in bad["figure"], bad


# ---------------------------------------------------------------- the CPU run (started with the module's first test)
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
            name = f"dynamic-cp sim-ring C4 docs 48/104/8/40 {kernel} {dtype} causal GQA 8/2"  # dynamic CP's layout
            assert rows[name]["status"] == "PASS", rows.get(name)
            assert set(rows[name]["detail"]["err"]) == {"out", "lse", "dq", "dk", "dv"}
    assert {s["kernel"] for s in summary["skipped"]} == {"flash", "efficient", "cudnn", "flash_attn", "te"}
    for kernel in KERNELS:  # windows, sinks and MLA's head dims (tests/gpu/test_masks.py)
        for dtype in DTYPES + ("fp64",):
            for variant in ("window 24 + sink", "MLA 192/128 + sink", "MLA latent r64 + sink"):
                name = f"masks {variant} {kernel} {dtype}"
                assert rows[name]["status"] == "PASS", rows.get(name)
                grads = ("dlatent", "dweight") if "latent" in variant else ("dk", "dv")
                assert set(rows[name]["detail"]["err"]) == {"out", "dq", "doffset", *grads}
    env = summary["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and "date" in env


def test_cpu_run_says_multi_gpu_part_not_covered(cpu_run):
    proc, summary = cpu_run
    multi = [r for r in summary["rows"] if r["part"] == "multi"]
    assert [r["check"] for r in multi] == list(MULTI_GPU) and len(multi) == 4, multi
    assert all(r["status"] == "not covered" for r in multi), multi
    last = proc.stdout.strip().splitlines()[-2]
    assert last.startswith("gpu_check: PASSED") and "NOT covered" in last and "NCCL attention" in last, last
