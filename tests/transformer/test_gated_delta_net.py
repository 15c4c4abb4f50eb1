"""cp_ext's Gated DeltaNet module (`cp_ext.transformer.gated_delta_net`) against transformers, megatron-core 0.19's
own GDN, and itself at CP = 1.

(a) One process (`run_code`), CP = TP = 1, both megatron releases: weights copied from transformers 5.25's
    ``Qwen3NextGatedDeltaNet`` through `cp_ext.hf.gated_delta_net_layout.hf_to_megatron_state_dict` (the HF import's layout),
    s = 100 (not a multiple of the 64-token chunk): the output and every parameter gradient (compared through
    the mapping) equal transformers' in fp32 to 1e-5 of the largest reference value. fp32 only: transformers' torch rule
    casts to fp32 itself, so fp64 would still compare against fp32 arithmetic.
(b) The same process, megatron-core >= 0.19 only: the state dict loads by name (strict) into megatron's own
    ``GatedDeltaNet`` (ColumnParallelLinear / torch RMSNorm / RowParallelLinear, ``deterministic_mode``: its
    torch rule and ``F.conv1d``) and gives the same output. megatron's GDN refuses to build without fla
    (flash-linear-attention), even on its torch path, which still calls fla's ``l2norm``: without fla the
    script stands in a module ``fla`` whose ``l2norm`` is fla's formula (x * rsqrt(sum x^2 + 1e-6)); fla's
    kernels themselves are never called.
(c) One launch of 4 gloo ranks: CP 2 (zigzag), CP 4 (zigzag, contiguous, and zigzag with packed documents)
    and TP 2 x CP 2 (with and without sequence parallelism, packed documents in one) equal CP = TP = 1: the
    output rows and input gradient at this rank's positions, and every parameter gradient (summed over CP as
    megatron's DP x CP reduction would; TP shards compared through `tp_shard_state_dict`), fp32.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import launch, one_rank_megatron, run_code, selected, worker_args, write_results  # noqa: E402

DIMS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
HIDDEN, KERNEL = 64, 4
GRIDS = {  # name: (tp, cp, layout, documents, sequence parallel)
    "cp2_zigzag": (1, 2, "zigzag", False, False),
    "cp4_zigzag": (1, 4, "zigzag", False, False),
    "cp4_contiguous": (1, 4, "contiguous", False, False),
    "cp4_zigzag_docs": (1, 4, "zigzag", True, False),
    "tp2_cp2_docs": (2, 2, "zigzag", True, False),
    "tp2_cp2_sp": (2, 2, "contiguous", False, True),
}
QUICK = ["tp2_cp2_docs"]
TOL = 1e-5  # of the largest reference value (fp32)
# dt_bias and A_log: each gradient entry sums one head's contributions over every token (b x s terms that
# largely cancel), so two fp32 evaluations in different orders differ more (measured: up to 1.6e-5).
TOLS = {"grad dt_bias": 5e-5, "grad A_log": 5e-5}


def _config(dtype, tp=1, cp=1, layout="zigzag", sp=False, **extra):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, params_dtype=dtype,
                               layernorm_epsilon=1e-6, use_cpu_initialization=True, normalization="RMSNorm",
                               tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
                               activation_func=torch.nn.functional.silu, **extra)
    config.cp_layout = layout
    return config


# --- (a) and (b): one process -------------------------------------------------------------------------

SINGLE = """
import importlib.util, json, sys, types
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
from cp_ext.megatron_version import at_least, installed
from cp_ext.hf.gated_delta_net_layout import hf_to_megatron_state_dict
from cp_ext.transformer.gated_delta_net import GatedDeltaNet
from tests.transformer.test_gated_delta_net import DIMS, HIDDEN, KERNEL, _config
torch.set_num_threads(1)
results = {}
hf_config = Qwen3NextConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                            linear_conv_kernel_dim=KERNEL, rms_norm_eps=1e-6, hidden_act="silu", **DIMS)
torch.manual_seed(0)
hf = Qwen3NextGatedDeltaNet(hf_config, 0)
with torch.no_grad():  # away from the init's ones, so a wrong norm or dt_bias mapping shows
    hf.norm.weight.normal_(1.0, 0.2)
    hf.dt_bias.normal_(0.0, 0.5)
module = GatedDeltaNet(_config(torch.float32), linear_conv_kernel_dim=KERNEL, **DIMS)
module.load_state_dict(hf_to_megatron_state_dict({k: v.detach() for k, v in hf.state_dict().items()}, **DIMS))
x = torch.randn(2, 100, HIDDEN)  # [b, s, hidden]: s = 100, not a multiple of the 64-token chunk
dy = torch.randn(2, 100, HIDDEN)
x_hf, x_meg = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
y_hf = hf(x_hf)
y, bias = module(x_meg)
y_hf.backward(dy)
y.backward(dy.transpose(0, 1))
hf_grads = hf_to_megatron_state_dict({n: p.grad for n, p in hf.named_parameters()}, **DIMS)
def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
err = {"out": rel(y.transpose(0, 1), y_hf), "dx": rel(x_meg.grad.transpose(0, 1), x_hf.grad)}
err.update({f"grad {n}": rel(p.grad, hf_grads[n]) for n, p in module.named_parameters()})
results["hf"] = {"err": err, "bias_is_none": bias is None, "grads": sorted(n for n, _ in module.named_parameters())}

if at_least(installed(), "0.19"):
    if importlib.util.find_spec("fla") is None:  # megatron's GDN needs fla to build; its torch path calls l2norm
        def l2norm(x, dim=-1, eps=1e-6):
            return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
        for name, attrs in {"fla": {}, "fla.modules": {}, "fla.modules.convolution": {"causal_conv1d": None},
                            "fla.modules.l2norm": {"l2norm": l2norm}, "fla.ops": {},
                            "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": None}}.items():
            stub = types.ModuleType(name)
            stub.__dict__.update(attrs)
            sys.modules[name] = stub
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGDN, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    config = _config(torch.float32, deterministic_mode=True, linear_conv_kernel_dim=KERNEL, **DIMS)
    megatron_gdn = MegatronGDN(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                               out_proj=RowParallelLinear),
                               layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups(["tp", "cp"]))
    theirs = {k: tuple(v.shape) for k, v in megatron_gdn.state_dict().items() if v is not None}
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items() if v is not None}
    megatron_gdn.load_state_dict(module.state_dict(), strict=True)
    with torch.no_grad():
        results["megatron"] = {"same_names_shapes": theirs == ours, "names": sorted(theirs),
                               "out": rel(megatron_gdn(x.transpose(0, 1), None)[0], y)}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gdn")
    proc = run_code(one_rank_megatron(tmp) + textwrap.dedent(SINGLE))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.mark.quick
def test_equals_transformers_qwen3_next(single):
    r = single["hf"]
    assert r["bias_is_none"]
    assert r["grads"] == ["A_log", "conv1d.weight", "dt_bias", "in_proj.weight", "out_norm.weight", "out_proj.weight"]
    bad = {k: v for k, v in r["err"].items() if not v <= TOLS.get(k, TOL)}
    assert not bad and len(r["err"]) == 8, (bad, r["err"])


def test_state_dict_loads_into_megatron_gdn(single):
    from cp_ext.megatron_version import at_least, installed

    if not at_least(installed(), "0.19"):
        pytest.skip(f"megatron-core {installed()} has no megatron.core.ssm.gated_delta_net (checked on 0.19.x)")
    r = single["megatron"]
    assert r["same_names_shapes"], r["names"]
    assert r["out"] <= TOL, r["out"]


def test_validation_names_megatron_flags():
    import torch

    from cp_ext.transformer.gated_delta_net import GatedDeltaNet

    config = _config(torch.float32, tp=2)
    for change, message in ((dict(linear_num_key_heads=3, linear_num_value_heads=6),
                             r"--linear-num-key-heads \(3\) must be divisible by --tensor-model-parallel-size \(2\)"),
                            (dict(linear_num_key_heads=4, linear_num_value_heads=6), r"--linear-num-value-heads \(6\) must be a multiple of"),
                            (dict(linear_num_value_heads=2, linear_num_key_heads=4), r"--linear-num-value-heads \(2\)"),
                            (dict(linear_conv_kernel_dim=0), "--linear-conv-kernel-dim must be a positive integer")):
        kw = {**DIMS, "linear_conv_kernel_dim": KERNEL, **change}
        with pytest.raises(ValueError, match=message):
            GatedDeltaNet(config, **kw)


# --- (c) multi-rank: one launch of 4 gloo ranks -------------------------------------------------------

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
    from cp_ext.hf.gated_delta_net_layout import tp_shard_state_dict
    from cp_ext.transformer.gated_delta_net import GatedDeltaNet

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
    ref_module = GatedDeltaNet(_config(torch.float32), linear_conv_kernel_dim=KERNEL, **DIMS)
    with torch.no_grad():
        ref_module.out_norm.weight.normal_(1.0, 0.2, generator=g)
        ref_module.dt_bias.normal_(0.0, 0.5, generator=g)
    ref_state = {k: v.detach().clone() for k, v in ref_module.state_dict().items() if v is not None}
    refs = {with_docs: _run(ref_module, x, dy, docs if with_docs else None) for with_docs in (False, True)}
    results = {}
    for case in selected(list(GRIDS), args):
        tp, cp, layout, with_docs, sp = GRIDS[case]
        grid(tp, cp)
        module = GatedDeltaNet(_config(torch.float32, tp, cp, layout, sp), linear_conv_kernel_dim=KERNEL, **DIMS)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        module.load_state_dict(tp_shard_state_dict(ref_state, tp_rank, tp, **DIMS), strict=False)
        pos = ps.get_context_parallel_positions(s, layout)
        rows = pos.chunk(tp)[tp_rank] if sp else pos  # sequence parallel: this TP rank's part of the CP shard
        out, dx, grads = _run(module, x.index_select(0, rows), dy.index_select(0, rows),
                              docs[:, pos] if with_docs else None)
        ref_out, ref_dx, ref_grads = refs[with_docs]
        ref_grads = tp_shard_state_dict(ref_grads, tp_rank, tp, **DIMS)

        def rel(a, ref):
            return ((a - ref).abs().max() / ref.abs().max().clamp(min=1)).item()

        err = {"out": rel(out, ref_out.index_select(0, rows)), "dx": rel(dx, ref_dx.index_select(0, rows))}
        for name, grad in grads.items():
            dist.all_reduce(grad, group=mpu.get_context_parallel_group())  # megatron's DP x CP sum, over CP
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
        assert r["grads"] == ["A_log", "conv1d.weight", "dt_bias", "in_proj.weight", "out_norm.weight",
                              "out_proj.weight"], r["grads"]
        bad = {k: v for k, v in r["err"].items() if not v <= TOLS.get(k, TOL)}
        assert not bad, (rank, case, bad, r["err"])


if __name__ == "__main__":
    main()
