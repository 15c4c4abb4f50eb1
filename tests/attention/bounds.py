"""How far an attention result may be from float64 truth: the bounds the ring test and the GPU check share.

Every bound is per tensor, on the max |error| against float64 truth, and starts from "ref": the
error of the same full-sequence attention on one device in the dtype. What a context-parallel
path may add to that:

* bf16 / fp16: each ring step's block output is rounded to the dtype before the fp32 merge, one
  rounding of up to ``LOW_PREC_SLACK[dtype]`` x max|truth| beyond 2 x ref (docs/attention.md).
  tests/attention/cp/test_ring.py holds the ring to exactly this; `gpu_check_bound` adds a cap.
* The GPU check (`gpu_check_bound`, tests/gpu): every kernel x dtype through the ring on one
  device, windows, sinks and MLA through each kernel, and ring / Ulysses / hybrid over NCCL:

  - fp32: <= 2 x ref and <= ``FP32_CAP``. 2 x ref is the rounding a correct ring may add (its extra
    sums are LSE merges and C-term fp32 accumulations); 1e-4 is ~100x the fp32 error at the check's
    sizes (unit-variance inputs, max|truth| <~ 10) and ~1000x below what a wrong merge, half tile or
    LSE gives, so a reference that is itself broken cannot carry the ring through. TF32 is off.
  - fp64: <= 2 x ref + ``FP64_FLOOR`` (on the CPU the float64 reference is the truth itself, error
    0), and <= ``FP64_CAP``.
  - bf16 / fp16: <= 2 x ref + 2**-8 x max|truth| (bf16's slack, for fp16 as well: the GPU's fp16
    kernels were never measured against the CPU ring test's 2**-11), and <= ``LOW_PREC_CAP`` x
    max|truth| (~3x the worst bf16 error measured on CPU, 1.1%): as for fp32, a broken reference
    must not widen the bound.

The CP tests' fp32 rule, with its merge term and RMS bound, is `tests.attention.reference.check_bounds`.
"""

import math

LOW_PREC_SLACK = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # x max|truth|: one rounding of a block output
FP32_CAP = 1e-4
FP64_FLOOR, FP64_CAP = 1e-12, 1e-10
LOW_PREC_CAP = 2.0 ** -5  # x max|truth|


def gpu_check_bound(dtype: str, ref_err: float, max_truth: float) -> float:
    """The GPU check's bound on one tensor's max |error| (module docstring); ``dtype`` "fp64" / "fp32" /
    "bf16" / "fp16"."""
    if dtype == "fp64":
        return min(2 * ref_err + FP64_FLOOR, FP64_CAP)
    if dtype == "fp32":
        return min(2 * ref_err, FP32_CAP)
    return min(2 * ref_err + LOW_PREC_SLACK["bf16"] * max_truth, LOW_PREC_CAP * max_truth)


def ratio_to_bound(err: float, bound: float) -> float:
    """err / bound: <= 1 is within; an error of exactly 0 is within any bound; NaN is over."""
    if err == 0:
        return 0.0
    ratio = err / bound if bound > 0 else math.inf
    return ratio if ratio == ratio else math.inf


FP32_ULP = 2.0 ** -23


def shard_errors(got, truth, positions, names, whole=()):
    """{name: (max |error|, max |truth|)} of this rank's rows (``positions`` of the sequence dim 0) of each
    tensor in ``names``; those in ``whole`` (a weight, a loss) compared whole."""
    out = {}
    for name in names:
        want = truth[name] if name in whole else truth[name].index_select(0, positions)
        out[name] = ((got[name].double() - want).abs().max().item(), want.abs().max().item())
    return out


def check_twice_single_device(err, ref_err, names, shares=None):
    """Every tensor within 2x the single-device fp32 error (``ref_err``, from `shard_errors`) plus one fp32
    ulp of its largest true value (the DSA tests' bound).

    ``shares``: {name: n} for a tensor that is the fp32 sum of n ranks' shares (a CP loss, all-reduced as
    the trainer reports it). The single-device error has no such sum: each of its n - 1 additions may
    round by up to an ulp of the total, so its ulp term is n ulps (measured: ring 4's sparse loss at 1.15
    ulps of the truth, beyond 2x the single-device 0.06 ulps)."""
    shares = shares or {}
    for name in names:
        (e, truth), r = err[name], ref_err[name][0]
        ulps = shares.get(name, 1)
        bound = 2 * r + ulps * FP32_ULP * truth
        assert e <= bound, f"{name}: error {e:.3g} > 2 x single-device {r:.3g} + {ulps} ulp ({bound:.3g})"
