"""The evaluation flags: their errors and the validation and test splits."""

import pytest

from tests.arguments.common import _error


@pytest.mark.parametrize(
    "argv, must_name",
    [
        (["--eval-interval", "0"], ["--eval-interval: must be an integer >= 1 (got 0)"]),
        (["--eval-interval", "5", "--eval-iters", "-1"], ["--eval-iters: must be an integer >= 0 (got -1)"]),
        (["--eval-interval", "5", "--split", "100,0,0"], ["--eval-interval needs validation data", "--valid-data-path"]),
        (["--eval-interval", "5", "--split", "abc"], ["--split abc: expected up to three"]),
        (["--skip-train", "--split", "1"], ["--eval-interval needs validation data"]),
        (["--eval-interval", "5", "--valid-data-path", "/nonexistent/prefix"], ["/nonexistent/prefix"]),
    ],
    ids=["interval-0", "iters-negative", "no-valid-split", "split-malformed", "skip-train-without-valid",
         "missing-valid-data"],
)
def test_bad_evaluation_flags_name_the_flag(argv, must_name):
    message = _error(argv, 1)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_evaluation_splits():
    from cp_ext.arguments import evaluation_splits, parse_args

    assert evaluation_splits(parse_args(["--eval-interval", "5"], world_size=1)) == ["valid", "test"]
    assert evaluation_splits(parse_args(["--eval-interval", "5", "--split", "9,1,0"], world_size=1)) == ["valid"]
    assert evaluation_splits(parse_args(["--eval-interval", "5", "--eval-iters", "0"], world_size=1)) == []
    assert evaluation_splits(parse_args([], world_size=1)) == []  # off unless asked for, unlike Megatron-LM
