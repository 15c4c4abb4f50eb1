"""cp_ext.grid.Grid: the one grid description. Its sizes-only rules (`Grid.problems`) are what the
argument layer reports for a launch whose world the grid does not tile."""

import pytest

from cp_ext.arguments import ConfigError, parse_args
from cp_ext.grid import Grid


@pytest.mark.parametrize("grid, world, says", [
    (Grid(tp=2, pp=2, cp=2, dp=1), 8, None),
    (Grid(tp=2, pp=1, cp=4, dp=1), 12, "world size 12 is not divisible by --tensor-model-parallel-size (2) x "
                                       "--pipeline-model-parallel-size (1) x --context-parallel-size (4) = 8"),
    (Grid(tp=1, pp=2, cp=1, dp=2, ep=4), 4, "world size 4 is not divisible by --expert-tensor-parallel-size (1) x "
                                            "--expert-model-parallel-size (4) x --pipeline-model-parallel-size (2)"),
    (Grid(tp=1, pp=1, cp=2, dp=4, ep=8), 8, None),  # EP folds into DP x CP: 8 expert ranks on 8
], ids=["tiles", "tp-pp-cp", "expert", "ep-over-dp-cp"])
def test_problems_name_the_flags(grid, world, says):
    problems = grid.problems(world)
    if says is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(says), problems


def test_parse_args_reports_the_grids_problem_once():
    flags = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4", "--seq-length", "64"]
    with pytest.raises(ConfigError) as e:
        parse_args(flags, world_size=12)
    assert str(e.value).count("world size 12 is not divisible") == 1, str(e.value)
    args = parse_args(flags, world_size=16)
    assert Grid.problems_of(args) == [] and Grid.from_args(args) == Grid(tp=2, cp=4, dp=2, etp=2, ulysses=args.ulysses_size)
