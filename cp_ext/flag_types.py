"""Flag building blocks shared by every option group (training, data, tools): range-checked number
types, list expressions, the parser whose errors are ConfigErrors, and the frozen run configuration."""

import argparse
import math

from cp_ext.errors import ConfigError


def number(kind, low=None, high=None, *, above=False, below=False):
    """An argparse ``type``: an int or a finite float in [low, high] (``above``/``below``: open ends).

    The range is checked where the value is parsed, for the command line and YAML alike, so a
    0 or a NaN never reaches a default (``--ffn-hidden-size 0``) or a division
    (``--num-attention-heads 0``)."""
    what = "an integer" if kind is int else "a number"
    bounds = [f"{'>' if above else '>='} {low}" if low is not None else None,
              f"{'<' if below else '<='} {high}" if high is not None else None]
    expected = f"{what} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (kind is float and not math.isfinite(value)) or (low is not None and (value < low or above and value == low)) \
                or (high is not None and (value > high or below and value == high)):
            raise argparse.ArgumentTypeError(f"must be {expected} (got {text})")
        return value

    parse.__name__ = expected  # what argparse's own messages call the type
    return parse


POSITIVE = number(int, 1)


NON_NEGATIVE = number(int, 0)


FRACTION = number(float, 0, 1, below=True)  # dropout, Adam betas


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors: one message from rank 0, exit 2, on every launch path."""

    def error(self, message):
        hint = " (pretrain_moe.py --help lists the flags)" if message.startswith("unrecognized") else ""
        raise ConfigError(f"  - {message.removeprefix('argument ')}{hint}")


class RunArgs(argparse.Namespace):
    """The run configuration: validated once by `parse_args`, then frozen.

    Components read it and never write it (each keeps what it derives, e.g. the trainer's
    padded vocabulary), so what a run was configured with is what it ran with."""

    def freeze(self):
        self.__class__ = _FrozenRunArgs  # no marker in vars(args): config.yaml and checkpoints stay clean
        return self


class _FrozenRunArgs(RunArgs):
    def __setattr__(self, name, value):
        raise AttributeError(f"the run configuration is frozen after validation; cannot set args.{name} "
                             f"(keep derived values on the component that derives them)")

    def __delattr__(self, name):
        self.__setattr__(name, None)



MAX_LIST_EXPRESSION = 100_000  # more entries than any model has layers: a typo, not a model


def list_expression(text, example):
    """Megatron-LM's list-expression flags (``([0]*3+[1])*12``): integers, lists of integers, ``+`` and ``*``,
    evaluated node by node without ``eval``, and refused (argparse's error, naming ``example``) beyond
    `MAX_LIST_EXPRESSION` entries before they are built: ``[0]*10**9`` or ``9**9**9`` would never return."""
    import ast

    def fail(why):
        raise argparse.ArgumentTypeError(f"{why}; expected a list expression such as {example}, got {text!r}")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = value(node.operand)
            return -inner if isinstance(inner, int) else fail("a minus before a list")
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            return items if all(isinstance(i, int) for i in items) else fail("a list inside a list")
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return a + b if isinstance(a, list) == isinstance(b, list) else fail("a list plus a number")
            if isinstance(a, int) and isinstance(b, int):
                return a * b if abs(a * b) <= MAX_LIST_EXPRESSION else fail("a number too large")
            items, times = (a, b) if isinstance(a, list) else (b, a)
            if not isinstance(items, list) or not isinstance(times, int):
                return fail("a list times a list")
            if len(items) * max(times, 0) > MAX_LIST_EXPRESSION:
                return fail(f"more than {MAX_LIST_EXPRESSION} entries")
            return items * times
        return fail("only integers, [lists], + and * are read")

    try:
        tree = ast.parse(str(text).strip(), mode="eval")
    except SyntaxError:
        fail("not an expression")
    result = value(tree.body)
    if not isinstance(result, list):
        fail("not a list")
    return result


def layer_freq_type(text):
    """Megatron's ``moe_freq_type``: an int N, or a Python list expression of 0/1 such as "[1,1,0]*2".

    Read by --moe-layer-freq (1: MoE layer) and --window-attn-skip-freq (1: windowed layer)."""
    text = str(text).strip()
    if "[" not in text:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or a list expression such as [1,1,0]*2, "
                                             f"got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        return value
    value = list_expression(text, "[1,1,0]*2")
    if any(x not in (0, 1) for x in value):
        raise argparse.ArgumentTypeError(f"expected a list of 0 and 1, got {value!r}")
    return value


def flags_off_default(args, parser, dests):
    """The flags among `dests` that this run sets off the parser's defaults, as --flag-names."""
    return ["--" + dest.replace("_", "-") for dest in dests if getattr(args, dest) != parser.get_default(dest)]
