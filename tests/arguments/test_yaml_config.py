"""YAML configs (`cp_ext.arguments.yaml_config`): defaults that flags override, unknown keys, the bundled configs,
and a bad flag failing once, on rank 0, before any work."""

import os

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import _error
from tests.launch import REPO_ROOT, run_script


def test_yaml_supplies_defaults_and_flags_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 96\nnum-attention-heads: 4\nlr: 0.01\n")
    args = parse_args(["--config", str(cfg), "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2"], world_size=1)
    assert (args.num_layers, args.hidden_size, args.lr) == (2, 96, 0.01)


@pytest.mark.quick
def test_yaml_unknown_key_is_an_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layer: 6\n")
    assert "unknown key 'num-layer'" in _error(["--config", str(cfg)], 1)


# Each bundled config and the world size it is written for.
BUNDLED = {"cpu_demo.yaml": 4, "cpu_passkey.yaml": 2, "cpu_long_64k.yaml": 4, "mixtral_8x7b_32k_2x8gpu.yaml": 16,
           "mixtral_8x7b_128k_4x8gpu.yaml": 32, "deepseek_v3_128k_32x8gpu.yaml": 256,
           "qwen3_30b_a3b_128k_8x8gpu.yaml": 64, "gpt_oss_120b_128k_8x8gpu.yaml": 64}


@pytest.mark.quick
def test_bundled_configs_parse(monkeypatch):
    # The GPU configs say device: cuda, which this host may lack: validate them as on a CUDA host.
    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)
    found = sorted(n for n in os.listdir(REPO_ROOT / "configs") if n.endswith(".yaml"))
    assert found == sorted(BUNDLED), "add new configs to BUNDLED with their world size"
    for name, world in BUNDLED.items():
        parse_args(["--config", str(REPO_ROOT / "configs" / name)], world_size=world)


def test_bad_flags_fail_once_on_rank_0_before_any_work():
    """Two ranks, a bad grid: exit status 2 on every rank, one message, no hang."""
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2",
                      torchrun=True, check=False, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2") == 1, proc.stderr
    assert "Traceback" not in proc.stderr.split("configuration error")[0]
