"""cp_ext's Kimi Delta Attention module (`cp_ext.transformer.kimi_delta_attention`) against transformers and against
itself at CP = TP = 1.

(a) One process (`run_code`), CP = TP = 1, both megatron releases: weights copied from transformers 5.25's
    ``KimiLinearDeltaAttention`` through `cp_ext.hf.kda_layout.hf_to_megatron_state_dict`, s = 100 (not a multiple
    of the 64-token chunk): the output, the input gradient and every parameter gradient (compared through the
    mapping) equal transformers' in fp32 to 1e-5 of the largest reference value; the mapping's inverse gives
    transformers' state dict back.
(b) One launch of 4 gloo ranks: CP 2 (zigzag), CP 4 (zigzag with packed documents, contiguous) and TP 2 x CP 2
    (packed documents; and with sequence parallelism) equal CP = TP = 1: the output rows and input gradient at this
    rank's positions, and every parameter gradient (summed over CP as megatron's DP x CP reduction would; over TP too
    for the sequence-parallel down projections, as its ``finalize_model_grads``; TP shards compared through
    `tp_shard_state_dict`), fp32.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import launch, one_rank_megatron, run_code, selected, worker_args, write_results  # noqa: E402

HEADS, HEAD_DIM, HIDDEN, KERNEL = 4, 16, 64, 4
DIMS = dict(linear_num_key_heads=HEADS, linear_num_value_heads=HEADS, linear_key_head_dim=HEAD_DIM,
            linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=KERNEL)
SHARD = dict(linear_num_key_heads=HEADS, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM)
PARAMS = ["A_log", "beta_proj.weight", "conv1d.weight", "dt_bias", "f_a_proj.weight", "f_b_proj.weight",
          "g_a_proj.weight", "g_b_proj.weight", "in_proj.weight", "out_norm.weight", "out_proj.weight"]
GRIDS = {  # name: (tp, cp, layout, documents, sequence parallel)
    "cp2_zigzag": (1, 2, "zigzag", False, False),
    "cp4_zigzag_docs": (1, 4, "zigzag", True, False),
    "cp4_contiguous": (1, 4, "contiguous", False, False),
    "tp2_cp2_docs": (2, 2, "zigzag", True, False),
    "tp2_cp2_sp": (2, 2, "contiguous", False, True),
}
QUICK = ["tp2_cp2_docs"]
TOL = 1e-5  # of the largest reference value (fp32)
# dt_bias and A_log: each gradient entry sums one head's (channel's) contributions over every token, terms that
# largely cancel, so two fp32 evaluations in different orders differ more (as Gated DeltaNet's, 5e-5).
TOLS = {"grad dt_bias": 5e-5, "grad A_log": 5e-5}


def _config(dtype, tp=1, cp=1, layout="zigzag", sp=False):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, params_dtype=dtype,
                               layernorm_epsilon=1e-5, use_cpu_initialization=True, normalization="RMSNorm",
                               tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                               activation_func=torch.nn.functional.silu)
    config.cp_layout = layout
    return config


# --- (a): one process ----------------------------------------------------------------------------------

SINGLE = """
import json
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
from cp_ext.hf.kda_layout import hf_to_megatron_state_dict, megatron_to_hf_state_dict
from cp_ext.transformer.kimi_delta_attention import KimiDeltaAttention
from tests.transformer.test_kimi_delta_attention import DIMS, HEADS, HEAD_DIM, HIDDEN, KERNEL, _config
torch.set_num_threads(1)
hf_config = KimiLinearConfig(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=1, linear_num_heads=HEADS,
                             linear_head_dim=HEAD_DIM, linear_conv_kernel_dim=KERNEL, rms_norm_eps=1e-5,
                             hidden_act="silu", layer_types=["linear_attention"])
torch.manual_seed(0)
hf = KimiLinearDeltaAttention(hf_config, 0)
with torch.no_grad():  # transformers leaves A_log, dt_bias empty until its model's init: FLA's init, then moved
    hf.forget_gate.A_log.copy_(torch.empty_like(hf.forget_gate.A_log).uniform_(1, 16).log())
    hf.forget_gate.dt_bias.normal_(0.0, 1.0)
    hf.o_norm.weight.normal_(1.0, 0.2)  # away from ones, so a wrong norm mapping shows
module = KimiDeltaAttention(_config(torch.float32), **DIMS)
hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
module.load_state_dict(hf_to_megatron_state_dict(hf_state), strict=True)
back = megatron_to_hf_state_dict(module.state_dict(), linear_num_key_heads=HEADS, linear_key_head_dim=HEAD_DIM)
x = torch.randn(2, 100, HIDDEN)  # [b, s, hidden]: s = 100, not a multiple of the 64-token chunk
dy = torch.randn(2, 100, HIDDEN)
x_hf, x_meg = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
y_hf = hf(x_hf)
y, bias = module(x_meg)
y_hf.backward(dy)
y.backward(dy.transpose(0, 1))
hf_grads = hf_to_megatron_state_dict({n: p.grad for n, p in hf.named_parameters()})
def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
err = {"out": rel(y.transpose(0, 1), y_hf), "dx": rel(x_meg.grad.transpose(0, 1), x_hf.grad)}
err.update({f"grad {n}": rel(p.grad, hf_grads[n]) for n, p in module.named_parameters()})
results = {"err": err, "bias_is_none": bias is None, "grads": sorted(n for n, _ in module.named_parameters()),
           "round_trip": sorted(back) == sorted(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in back)}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kda")
    proc = run_code(one_rank_megatron(tmp) + textwrap.dedent(SINGLE))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.mark.quick
def test_equals_transformers_kimi_linear(single):
    assert single["bias_is_none"] and single["round_trip"]
    assert single["grads"] == PARAMS
    bad = {k: v for k, v in single["err"].items() if not v <= TOLS.get(k, TOL)}
    assert not bad and len(single["err"]) == 2 + len(PARAMS), (bad, single["err"])


def test_validation_names_megatron_flags():
    import torch

    from cp_ext.transformer.kimi_delta_attention import KimiDeltaAttention

    config = _config(torch.float32, tp=2)
    for change, message in ((dict(linear_num_value_heads=8), r"no grouped value heads: --linear-num-value-heads \(8\) "
                                                             r"must equal --linear-num-key-heads \(4\)"),
                            (dict(linear_num_key_heads=3, linear_num_value_heads=3),
                             r"--linear-num-key-heads \(3\) must be divisible by --tensor-model-parallel-size \(2\)"),
                            (dict(linear_conv_kernel_dim=0), "--linear-conv-kernel-dim must be a positive integer")):
        with pytest.raises(ValueError, match=message):
            KimiDeltaAttention(config, **{**DIMS, **change})


# --- (b) multi-rank: one launch of 4 gloo ranks -------------------------------------------------------

def _run(module, x, dy, document_ids):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, attention_mask=document_ids)
    assert bias is None
    out.backward(dy)
    return out.detach(), x.grad.detach(), {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def main():
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from cp_ext import parallel_state as ps
    from cp_ext.platform import setup_platform
    from cp_ext.hf.kda_layout import tp_shard_state_dict
    from cp_ext.transformer.kimi_delta_attention import KimiDeltaAttention

    setup_platform("cpu")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    args = worker_args()
    s, b = 104, 2  # 8 zigzag chunks of 13 tokens at CP 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, HIDDEN, generator=g)
    dy = torch.randn(s, b, HIDDEN, generator=g)
    docs = torch.zeros(b, s, dtype=torch.long)  # documents crossing the CP boundaries, one shorter than the kernel
    for row, starts in enumerate(([17, 20, 51, 90], [40, 41, 77])):
        for start in starts:
            docs[row, start:] += 1

    def grid(tp, cp):
        ps.destroy_grid()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        ps.initialize_context_parallel(ulysses_size=1)
        model_parallel_cuda_manual_seed(1)

    grid(1, 1)  # CP = TP = 1 (DP 4): every rank the whole sequence
    ref_module = KimiDeltaAttention(_config(torch.float32), **DIMS)
    with torch.no_grad():
        ref_module.out_norm.weight.normal_(1.0, 0.2, generator=g)
        ref_module.dt_bias.normal_(0.0, 1.0, generator=g)
    ref_state = {k: v.detach().clone() for k, v in ref_module.state_dict().items() if v is not None}
    refs = {with_docs: _run(ref_module, x, dy, docs if with_docs else None) for with_docs in (False, True)}
    results = {}
    for case in selected(list(GRIDS), args):
        tp, cp, layout, with_docs, sp = GRIDS[case]
        grid(tp, cp)
        module = KimiDeltaAttention(_config(torch.float32, tp, cp, layout, sp), **DIMS)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        module.load_state_dict(tp_shard_state_dict(ref_state, tp_rank, tp, **SHARD), strict=True)
        pos = ps.get_context_parallel_positions(s, layout)
        rows = pos.chunk(tp)[tp_rank] if sp else pos  # sequence parallel: this TP rank's part of the CP shard
        out, dx, grads = _run(module, x.index_select(0, rows), dy.index_select(0, rows),
                              docs[:, pos] if with_docs else None)
        ref_out, ref_dx, ref_grads = refs[with_docs]
        ref_grads = tp_shard_state_dict(ref_grads, tp_rank, tp, **SHARD)

        def rel(a, ref):
            return ((a - ref).abs().max() / ref.abs().max().clamp(min=1)).item()

        err = {"out": rel(out, ref_out.index_select(0, rows)), "dx": rel(dx, ref_dx.index_select(0, rows))}
        params = dict(module.named_parameters())
        for name, grad in grads.items():
            dist.all_reduce(grad, group=mpu.get_context_parallel_group())  # megatron's DP x CP sum, over CP
            if sp and getattr(params[name], "sequence_parallel", False):  # finalize_model_grads' sum over TP
                dist.all_reduce(grad, group=mpu.get_tensor_model_parallel_group())
            err[f"grad {name}"] = rel(grad, ref_grads[name])
        results[case] = {"err": err, "grads": sorted(grads)}
    ps.destroy_grid()
    write_results(args.results_dir, results)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, 4, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.quick] if c in QUICK else []) for c in GRIDS])
def test_cp_and_tp_equal_cp1(results, case):
    for rank, res in results.items():
        r = res[case]
        assert r["grads"] == PARAMS, r["grads"]
        bad = {k: v for k, v in r["err"].items() if not v <= TOLS.get(k, TOL)}
        assert not bad, (rank, case, bad, r["err"])


if __name__ == "__main__":
    main()
