"""The documentation cannot drift from the code: every command it shows is checked here.

* docs/flags.md is what tools/docs_flags.py makes from the argument parser today;
* every command line of every ```bash block in README.md and docs/**/*.md: the files it names exist
  (configs, scripts, tools, tests); a `pretrain_moe.py` command's flags and `--config` YAML are
  accepted by cp_ext's parser and validated at the world size its torchrun implies; a tool's flags
  (`tools/X.py`, the `cp-ext-*` commands) are among those its own --help lists, and the flags it passes
  on to the trainer (after `--`) are the trainer's;
* README.md's links resolve, it stays short (<= 260 lines) and begins with its two commands;
* every cp_ext module, test file and script the pages name exists under that name.

Nothing here launches a run: parsing only, and `--help` of each tool named (in parallel, once).
"""

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").rglob("*.md"))
DOCUMENTS = [README, *PAGES]

DEMO_COMMAND = ("python3 -m pip install torch==2.13.0 && python3 -m pip install -e . && OMP_NUM_THREADS=1 torchrun "
                "--standalone --nproc-per-node 4 pretrain_moe.py --config configs/cpu_demo.yaml")
TEST_COMMAND = 'python3 -m pip install torch==2.13.0 && python3 -m pip install -e ".[dev]" && python3 -m pytest tests -q'
README_MAX_LINES = 260

# Tools that take every pretrain_moe.py flag beside their own (they build the trainer's model and grid).
TAKES_TRAINER_FLAGS = {"generate.py", "eval_long_context.py"}
TORCHRUN_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--node_rank", "--rdzv-backend",
                   "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--master-addr", "--master-port", "--max-restarts",
                   "--monitor-interval", "--start-method", "--log-dir", "--redirects", "--tee"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
PATH_ROOTS = ("configs/", "scripts/", "tools/", "tests/", "docs/")


# ----------------------------------------------------------------------------- reading the pages

def bash_blocks(path):
    """(line number, text) of every ```bash block in one Markdown file (indented blocks too)."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```bash\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m.group(1)), i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((start, "\n".join(body)))
        i += 1
    return blocks


def command_lines(block):
    """The block's command lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def simple_commands(line):
    """One command line cut into simple commands (token lists) at &&, ||, ;, |; redirections dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current, skip = [], [], False
    for token in lexer:
        if skip:
            skip = False
            continue
        if token in SEPARATORS:
            commands.append(current)
            current = []
        elif token in REDIRECTS or re.fullmatch(r"\d?>>?", token):
            skip = True
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


def all_commands():
    """(where, tokens) for every simple command in every bash block."""
    found = []
    for path in DOCUMENTS:
        for start, block in bash_blocks(path):
            for line in command_lines(block):
                for tokens in simple_commands(line):
                    found.append((f"{path.relative_to(REPO)}:{start}: {line[:120]}", tokens))
    return found


COMMANDS = all_commands()


def strip_environment(tokens):
    """(environment, rest): leading NAME=value words."""
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        name, value = tokens[0].split("=", 1)
        env[name] = value
        tokens = tokens[1:]
    return env, tokens


def is_python(program):
    return re.fullmatch(r"python(3(\.\d+)?)?", Path(program).name) is not None


def classify(tokens):
    """`_classify`, with a command cut short (`sbatch` without a script, ...) left to the generic checks."""
    try:
        return _classify(tokens)
    except IndexError:
        return ("other", tokens)


def _classify(tokens):
    """What a simple command runs: ("trainer", argv, world) | ("tool", name, argv) | ("script", path, argv, env)
    | ("pytest", argv) | ("other", tokens)."""
    env, tokens = strip_environment(tokens)
    if not tokens:
        return ("other", tokens)
    program, rest = tokens[0], tokens[1:]
    world = 1
    if program == "torchrun" or (is_python(program) and rest[:2] == ["-m", "torch.distributed.run"]):
        rest = rest[2:] if program != "torchrun" else rest
        nproc, nodes, i = 1, 1, 0
        while i < len(rest) and rest[i].startswith("-"):
            flag, _, value = rest[i].partition("=")
            if flag in TORCHRUN_VALUED and not value:
                value, i = rest[i + 1], i + 1
            if flag in ("--nproc-per-node", "--nproc_per_node"):
                nproc = int(value) if value.isdigit() else None  # a placeholder: the test says so
            elif flag == "--nnodes":
                nodes = int(value.split(":")[-1]) if value.split(":")[-1].isdigit() else None
            i += 1
        world, program, rest = (nproc * nodes if nproc and nodes else None), rest[i], rest[i + 1:]
    elif is_python(program):
        if rest[:1] == ["-m"]:
            if rest[1] == "pytest":
                return ("pytest", rest[2:])
            return ("other", tokens)
        if not rest:
            return ("other", tokens)
        program, rest = rest[0], rest[1:]
    elif program in ("bash", "sh"):
        program, rest = rest[0], rest[1:]
    elif program == "sbatch":
        i = 0
        while i < len(rest) and rest[i].startswith("-"):
            i += 1 + (rest[i] in ("-N", "-p", "-A", "-t", "-J", "-o", "-c"))
        program, rest = rest[i], rest[i + 1:]
    if program.endswith("pretrain_moe.py"):
        return ("trainer", rest, world)
    if program.startswith("tools/") and program.endswith(".py"):
        return ("tool", program, rest)
    if program.startswith("cp-ext-"):
        return ("tool", program, rest)
    if program.startswith(("scripts/", "tools/")):
        return ("script", program, rest, env)
    return ("other", tokens)


# ----------------------------------------------------------------------------- the parser's view

def trainer_options():
    from cp_ext.arguments import build_parser

    return {o for action in build_parser()._actions for o in action.option_strings}


def flags_of(argv):
    """The --flags of an argument list (values after '=' dropped), up to a bare '--'."""
    flags = []
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            flags.append(token.split("=", 1)[0])
    return flags


def after_separator(argv):
    return argv[argv.index("--") + 1:] if "--" in argv else []


def artifacts(argv):
    """The paths a command names that an earlier step makes (a checkpoint, a dataset, a tokenizer): any
    path-like value that does not exist in the repository and is not one of its own files."""
    found = set()
    for token in argv:
        if token.startswith("-") or token.startswith(PATH_ROOTS):
            continue
        if ("/" in token or re.fullmatch(r"[\w.-]+\.(json|jsonl|yaml|txt)|ck\w*|out\w*|data\w*", token)) \
                and not (REPO / token).exists():
            found.add(token)
    return found


def trainer_problems(argv, world, monkeypatch, tmp_path):
    """What cp_ext's parser says about a pretrain_moe.py command, at its world size, as on a CUDA host; problems
    about files an earlier step makes (a checkpoint to load, a tokenized corpus) are expected and left out."""
    from cp_ext.arguments import parse_args
    from cp_ext.errors import ConfigError

    argv = [a for a in argv if a != "..."]
    if {"--version", "--help", "-h"} & set(argv):  # these print and exit before any validation
        unknown = sorted(set(flags_of(argv)) - trainer_options())
        return [f"unrecognized arguments: {' '.join(unknown)}"] if unknown else []
    made = artifacts(argv)
    if "--config" in argv:  # a config an earlier step writes (an import's CKPT/model.yaml): its flags are not known here
        i = argv.index("--config")
        if argv[i + 1] in made:
            argv = argv[:i] + argv[i + 2:]
        else:
            argv = argv[:i + 1] + [str(REPO / argv[i + 1])] + argv[i + 2:]
    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)
    monkeypatch.chdir(tmp_path)  # whatever validation creates or reads by relative path stays out of the repository
    for name in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_STEP_NUM_NODES", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    try:
        parse_args(argv, world_size=world)
    except ConfigError as e:
        problems = [p for p in str(e).split("\n  - ") if p.strip()]
        return [p for p in problems
                if not any(re.search(rf"(?<![\w/.-]){re.escape(a)}(?![\w/-])", p) for a in made)]
    return []


# ----------------------------------------------------------------------------- the tools' view

def console_scripts():
    """pyproject.toml's [project.scripts]: command -> "module:function"."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10: the table's simple `name = "module:function"` lines
        table = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', table, re.M))
    return tomllib.loads(text)["project"]["scripts"]


def tool_command(name, sub=None):
    """The argv that runs a tool (tools/X.py, or a console script by pyproject's entry point)."""
    if name.startswith("cp-ext-"):
        module, function = console_scripts()[name].split(":")
        call = f"import sys; from {module} import {function} as main; sys.argv[0] = {name!r}; sys.exit(main())"
        argv = [sys.executable, "-c", call]
    else:
        argv = [sys.executable, name]
    return argv + ([sub] if sub else []) + ["--help"]


def _help_text(command):
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200")
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    return proc.stdout + proc.stderr


def options_in_help(text):
    """The option strings a --help (or usage error) lists: the usage block and the option column."""
    found, in_usage = set(), False
    for line in text.splitlines():
        if line.startswith("usage:"):
            in_usage = True
        elif not line.strip():
            in_usage = False
        if in_usage:
            found.update(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", line))
        elif re.match(r"^\s+-", line):
            found.update(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", re.split(r"\S\s{2,}", line.strip())[0]))
    return found


def options_in_source(name):
    """The option strings a tool's own source adds (a tool whose --help shows only the trainer's parser)."""
    if name.startswith("cp-ext-"):
        return set()
    return set(re.findall(r"add_argument\(\s*[\"'](--?[A-Za-z][\w-]*)", (REPO / name).read_text(encoding="utf-8")))


def subcommand(name, argv):
    """A tool's subcommand (convert_hf.py import), read from the choices its usage line lists."""
    text = HELP.get((name, None), "")
    choices = re.search(r"usage: \S+(?: \[-h\])? \{([\w,-]+)\}", text)
    if choices and argv and argv[0] in choices.group(1).split(","):
        return argv[0]
    return None


def tool_invocations():
    return [(c[1], c[2]) for _, tokens in COMMANDS if (c := classify(tokens))[0] == "tool"]


@lru_cache(maxsize=None)
def _collect_help():
    names = sorted({name for name, _ in tool_invocations()})
    help_ = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for name, text in zip(names, pool.map(lambda n: _help_text(tool_command(n)), names)):
            help_[(name, None)] = text
    HELP.update(help_)
    subs = sorted({(name, sub) for name, argv in tool_invocations() if (sub := subcommand(name, argv))})
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for key, text in zip(subs, pool.map(lambda k: _help_text(tool_command(*k)), subs)):
            help_[key] = text
    HELP.update(help_)
    return True


HELP = {}


# ----------------------------------------------------------------------------- the tests

@pytest.mark.quick
def test_flags_page_is_current():
    proc = subprocess.run([sys.executable, "tools/docs_flags.py", "--check", "docs/flags.md"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.quick
def test_readme_is_short_and_begins_with_its_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/"
    blocks = bash_blocks(README)
    assert len(blocks) >= 2 and [b for _, b in blocks[:2]] == [DEMO_COMMAND, TEST_COMMAND], \
        "README.md's first two ```bash blocks must be the demo command and the test command, exactly"
    assert blocks[1][0] <= 30, f"the two commands belong at the top of README.md (the second starts at line {blocks[1][0]})"
    assert text.split("```")[1].strip() == "bash\n" + DEMO_COMMAND, "no fenced block may come before the demo command"


def _headings(path):
    """The anchors Markdown's table of contents gives a page's headings."""
    import unicodedata

    anchors = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            value = re.sub(r"<[^>]+>|`", "", m.group(1))
            value = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode()
            value = re.sub(r"[^\w\s-]", "", value).strip().lower()
            anchors.add(re.sub(r"[-\s]+", "-", value))
    return anchors


@pytest.mark.quick
def test_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+://|mailto:", link):
            continue
        target, _, anchor = link.partition("#")
        path = REPO / target if target else README
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _headings(path):
            broken.append(f"{link}: no heading #{anchor} in {target or 'README.md'}")
    assert any(link.startswith("docs/") for link in links), "README.md should link into docs/"
    assert not broken, broken


@pytest.mark.quick
def test_every_file_a_command_names_exists():
    missing = []
    for where, tokens in COMMANDS:
        for token in tokens:
            value = token.split("=", 1)[-1] if token.startswith("--") else token
            if value.startswith(PATH_ROOTS) and not any(c in value for c in "*$<>{}") and not (REPO / value).exists():
                missing.append(f"{where}\n    names {value}, which does not exist")
    assert not missing, "\n".join(missing)


TRAINER_COMMANDS = [c for c in COMMANDS if classify(c[1])[0] == "trainer"]


@pytest.mark.parametrize("where, tokens", TRAINER_COMMANDS, ids=[w.split(": ", 1)[0] for w, _ in TRAINER_COMMANDS])
def test_trainer_commands_parse(where, tokens, monkeypatch, tmp_path):
    _, argv, world = classify(tokens)
    assert world is not None, f"{where}\n  give torchrun a number of ranks (and nodes), not a placeholder"
    problems = trainer_problems(argv, world, monkeypatch, tmp_path)
    assert not problems, f"{where}\n  at world size {world}:\n  - " + "\n  - ".join(problems)


@pytest.mark.quick
def test_flags_passed_through_scripts_are_trainer_flags():
    """scripts/*.sh and *.sbatch pass their extra arguments to pretrain_moe.py unchanged."""
    known, bad = trainer_options(), []
    for where, tokens in COMMANDS:
        kind = classify(tokens)
        if kind[0] == "script" and kind[1].startswith("scripts/"):
            bad += [f"{where}: {flag}" for flag in flags_of(kind[2]) if flag not in known]
    assert not bad, "flags pretrain_moe.py does not take:\n" + "\n".join(bad)


def test_tool_commands_use_flags_the_tools_take():
    _collect_help()
    trainer, bad = trainer_options(), []
    for where, tokens in COMMANDS:
        kind = classify(tokens)
        if kind[0] != "tool":
            continue
        name, argv = kind[1], kind[2]
        if not name.startswith("cp-ext-") and not (REPO / name).exists():
            bad.append(f"{where}: {name} does not exist")
            continue
        sub = subcommand(name, argv)
        text = HELP[(name, sub)]
        if "usage:" not in text:
            bad.append(f"{where}: `{name}{' ' + sub if sub else ''} --help` printed no usage:\n{text[-1500:]}")
            continue
        known = options_in_help(text)
        if Path(name).name in TAKES_TRAINER_FLAGS:
            known |= trainer | options_in_source(name)
        bad += [f"{where}: {name} takes no {flag}" for flag in flags_of(argv) if flag not in known]
        bad += [f"{where}: the trainer takes no {flag} (after --)" for flag in flags_of(after_separator(argv))
                if flag not in trainer]
    assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_pytest_commands_name_existing_tests_and_markers():
    conftest = (REPO / "tests" / "conftest.py").read_text()
    bad = []
    for where, tokens in COMMANDS:
        kind = classify(tokens)
        if kind[0] != "pytest":
            continue
        argv = kind[1]
        for i, token in enumerate(argv):
            if token.startswith("tests") and not (REPO / token.split("::")[0]).exists():
                bad.append(f"{where}: {token} does not exist")
            if token == "-m" and argv[i + 1] not in ("quick", "gpu", "multinode", "ci_leg") and \
                    f'"markers", "{argv[i + 1]}' not in conftest:
                bad.append(f"{where}: marker {argv[i + 1]} is not declared in tests/conftest.py")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- names in the prose

def _module_exists(dotted):
    """cp_ext.a.b.c: the longest prefix that is a module file or package under that name, then its next attribute
    (imported: an attribute that is an old module path, kept importable by cp_ext.moved_modules, does not count)."""
    import importlib
    import warnings

    from cp_ext.moved_modules import MOVED

    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            if n == len(parts):
                return True
            if ".".join(parts[:n + 1]) in MOVED:
                return False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return hasattr(importlib.import_module(".".join(parts[:n])), parts[n])
    return False


@pytest.mark.quick
def test_modules_files_and_tests_the_pages_name_exist():
    """Old module paths still import (with a DeprecationWarning), so only this catches a page naming one."""
    test_files = {p.name for p in (REPO / "tests").rglob("*.py")}
    bad = []
    for path in DOCUMENTS:
        if path.name == "changelog.md":
            continue
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(REPO)
        for name in sorted(set(re.findall(r"(?<![\w/.])cp_ext(?:\.[A-Za-z_]\w*)+", text))):
            if not _module_exists(name):
                bad.append(f"{where}: {name}")
        for name in sorted(set(re.findall(r"(?<![\w.])cp_ext/[\w/]+(?:\.py)?", text))):
            if not re.search(r"[A-Z]{2,}", name) and not (REPO / name).exists():
                bad.append(f"{where}: {name}")
        for m in re.finditer(r"(?<![\w/])(?:tests|scripts|configs|tools)/[\w./-]*\w", text):
            name = m.group(0)
            if text[m.end():m.end() + 1] == "*" or re.search(r"[A-Z]{2,}", name):  # a pattern or a placeholder (NAME)
                continue
            if not (REPO / name).exists():
                bad.append(f"{where}: {name}")
        for name in sorted(set(re.findall(r"(?<![\w/])test_\w+\.py", text))):
            if name not in test_files:
                bad.append(f"{where}: {name} (no such test file)")
    assert not bad, "names in the pages that do not exist:\n" + "\n".join(bad)
