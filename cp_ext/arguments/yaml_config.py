"""``--config FILE.yaml``: YAML keys are flag names, typed and checked by the flags' own parser."""

import argparse

import yaml

from cp_ext.errors import ConfigError


def read_yaml(path):
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"  - --config {path}: cannot read it ({e.strerror or e})")
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"  - --config {path}: not valid YAML: {e}")
    if not isinstance(values, dict):
        raise ConfigError(f"  - --config {path}: expected a mapping of flag names to values, e.g. num-layers: 4")
    return values


def yaml_tokens(parser, path, values, build_parser):
    """YAML keys -> the command-line tokens they stand for, so the same parser types them.

    ``bf16: "false"`` is not a boolean, ``device: gpu`` not a choice, ``seq-length: [128]``
    not an integer: each is the error its flag would give, naming the file and the key. A
    scalar for a list flag is a one-item list (``data-path: /x/prefix``)."""
    # A key is a flag's name (disable-bias-linear) or, for the flags named like it, its dest.
    flags = {option: action for action in parser._actions for option in action.option_strings}
    actions = {action.dest: action for action in parser._actions}
    tokens = []
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        flag = "--" + dest.replace("_", "-")
        action = flags.get(flag) or actions.get(dest)
        if action is None or dest in ("config", "help"):
            raise ConfigError(f"  - --config {path}: unknown key {key!r} (keys are flag names, e.g. num-layers)")
        if flag not in action.option_strings:
            flag = next(o for o in action.option_strings if o.startswith("--"))
        where = f"--config {path}: {key}: {value!r}"
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"  - {where} is not a boolean; write true or false (unquoted)")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else "--no-" + flag[2:])
            elif value:
                tokens.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        many = action.nargs in ("+", "*")
        if (not many and isinstance(value, list)) or any(isinstance(v, (list, dict)) for v in items) \
                or isinstance(value, dict):
            raise ConfigError(f"  - {where}: {flag} takes {'a list of values' if many else 'one value'}")
        if any(v is None or isinstance(v, bool) for v in items):
            raise ConfigError(f"  - {where}: give a value (or drop the key for the default)")
        key_tokens = [flag, *map(str, items)] if many else [f"{flag}={items[0]}"]
        try:
            build_parser().parse_args(key_tokens)  # the flag's own type and choices, blamed on the file
        except ConfigError as e:
            raise ConfigError(f"  - --config {path}: {key}: {str(e).strip().removeprefix('- ')}") from None
        tokens.extend(key_tokens)
    return tokens

