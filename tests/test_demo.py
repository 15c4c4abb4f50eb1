"""The README's main command: the embedded-default CPU run trains, in Megatron's log format.

The run is the README's (configs/cpu_demo.yaml on 4 ranks with torchrun's environment, forked from
the suite's pre-imported server) cut to 20 of its 60 iterations: the loss falls from 5.5 to 3.1 by
then, and the check asks for a fall of 1.5. The quick test ties the README's command, the demo
script and the config together; tests/scripts/test_launchers.py runs the script's torchrun line.
"""

import re

import pytest

from tests.launch import REPO_ROOT, run_script

LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): [\d.]+ \| "
    r"learning rate: [\d.]+E[+-]\d+ \| global batch size: +\d+ \| lm loss: (\d\.\d{6}E[+-]\d+) \| "
    r"load balancing loss: \d\.\d{6}E[+-]\d+ \| grad norm: [\d.]+ \| tokens per second: [\d.]+ \| eta: [\d:]+ \|$"
)
ITERATIONS = 20


def test_cpu_demo_loss_falls(tmp_path):
    proc = run_script(4, REPO_ROOT / "pretrain_moe.py", "--config", REPO_ROOT / "configs" / "cpu_demo.yaml",
                      "--train-iters", ITERATIONS, "--log-dir", tmp_path, timeout=900)
    lines = [m for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert lines, f"no Megatron-style iteration lines in:\n{proc.stdout[-3000:]}"
    assert int(lines[-1].group(1)) == int(lines[-1].group(2)) == ITERATIONS, "the run must reach --train-iters"
    first = float(re.search(r"training done: lm loss ([\d.]+)", proc.stdout).group(1))
    last = float(lines[-1].group(3))
    assert last < first - 1.5, f"loss should fall clearly: iteration 1 {first:.3f} -> last {last:.3f}"
    assert (tmp_path / "metrics.jsonl").exists()
    # every rank's peak memory, gathered to rank 0 (metrics.jsonl holds rank 0's only)
    peaks = re.search(r"^peak RSS per rank \(MiB\): ([\d ]+)$", proc.stdout, re.M)
    assert peaks and len(peaks.group(1).split()) == 4 and all(int(x) > 100 for x in peaks.group(1).split()), proc.stdout[-2000:]


@pytest.mark.quick
def test_readme_command_is_what_the_demo_script_runs():
    """The README's first command and scripts/run_cpu_demo.sh run what the test above runs:
    configs/cpu_demo.yaml on 4 ranks, a CP2 x DP2 grid with experts over EP2."""
    from cp_ext.arguments import parse_args

    readme = (REPO_ROOT / "README.md").read_text()
    command = "torchrun --standalone --nproc-per-node 4 pretrain_moe.py --config configs/cpu_demo.yaml"
    assert command in readme.split("```")[1], "the README's first command block changed"
    script = (REPO_ROOT / "scripts" / "run_cpu_demo.sh").read_text()
    assert 'cp_ext_int NPROC 4 ' in script and "pretrain_moe.py --config configs/cpu_demo.yaml" in script
    args = parse_args(["--config", str(REPO_ROOT / "configs" / "cpu_demo.yaml")], world_size=4)
    assert (args.context_parallel_size, args.data_parallel_size, args.expert_model_parallel_size) == (2, 2, 2)
    assert args.device == "cpu"
