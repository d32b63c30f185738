"""The commands and snippets of README.md and docs/ work as written.

Every fenced ```bash and ```python block of README.md and docs/**/*.md is read:

1. command lines (``hostreduce ...``, ``python -m ...``, ``python script.py ...``,
   ``bash scripts/...``, ``mpirun ... python ...``) name scripts, files and options that
   exist: ``hostreduce run`` options are checked against ``hostreduce run --help``, a
   script's ``--options`` against the script's argument parser sources;
2. Python blocks compile;
3. blocks whose info string says ``runnable`` (```python runnable, ```bash runnable)
   run, each in a subprocess with a timeout, from the repository root.

The quick-start commands themselves (a full set-up, and the whole suite) are not run:
their scripts must exist and parse (``bash -n``). Relative links between the documents
(files and #anchors) must resolve too.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
QUICK_START = ["bash scripts/run_mnist.sh", "bash scripts/test.sh"]
RUN_TIMEOUT_S = 240          # a cap for one runnable block, not an expected duration
REPO_DIRS = ("examples/", "benchmarks/", "scripts/", "tests/", "docs/")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int            # 1-based line of the block's first content line
    lang: str
    runnable: bool
    source: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        info = fence.group(1).split()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        found.append(Block(path, i + 2, info[0] if info else "", "runnable" in info[1:], "\n".join(lines[i + 1:j])))
        i = j + 1
    return found


BLOCKS = [b for doc in DOCUMENTS for b in _blocks(doc)]
BASH = [b for b in BLOCKS if b.lang in ("bash", "sh")]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUNNABLE = [b for b in BLOCKS if b.runnable]


# --- command lines -------------------------------------------------------------------

def _command_lines(source: str) -> Iterator[list[str]]:
    """Each command of a shell block as tokens: continuation lines joined, comments
    dropped, a quoted argument spanning lines kept whole."""
    pending = ""
    for line in source.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:          # an open quote: the command goes on
            pending += "\n"
            continue
        pending = ""
        if tokens:
            yield tokens
    assert not pending.strip(), f"unterminated command: {pending!r}"


@functools.lru_cache(maxsize=None)
def _run_options() -> dict[str, bool]:
    """``hostreduce run``'s options, from its --help: option -> whether it takes a value."""
    res = subprocess.run([sys.executable, "-m", "hostreduce", "run", "--help"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    options: dict[str, bool] = {}
    for line in res.stdout.splitlines():
        spec = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if spec:
            for item in spec.group(1).split(", "):
                flag, *metavar = item.split()
                options[flag] = bool(metavar)
    assert "-np" in options and "--ps" in options, res.stdout
    return options


def _check_paths(tokens: list[str], where: str) -> None:
    for token in tokens:
        if token.startswith(REPO_DIRS):
            assert (ROOT / token).exists(), f"{where}: {token} does not exist"


def _check_script_options(script: Path, args: list[str], where: str) -> None:
    """Every --option given to a repository script is one its parser (in the script's
    directory: the script or a module beside it) defines."""
    sources = "\n".join(p.read_text(encoding="utf-8") for p in script.parent.glob("*.py"))
    for arg in args:
        if arg.startswith("--") and len(arg) > 2:
            option = arg.split("=", 1)[0]
            assert f'"{option}"' in sources or f"'{option}'" in sources, (
                f"{where}: {script.relative_to(ROOT)} has no option {option}")


def _check_hostreduce(args: list[str], where: str) -> None:
    if args in (["--version"], ["--help"], ["-h"]):
        return
    assert args and args[0] == "run", f"{where}: `hostreduce {' '.join(args)}`: the only subcommand is `run`"
    options, rest = _run_options(), args[1:]
    while rest:
        token = rest[0]
        if token == "--":
            rest = rest[1:]
            break
        if not token.startswith("-"):
            break
        flag = token.split("=", 1)[0]
        assert flag in options, f"{where}: `hostreduce run` has no option {flag} (options: {sorted(options)})"
        rest = rest[1:] if (not options[flag] or "=" in token) else rest[2:]
    if rest:
        _check_command(rest, where)


def _check_python(args: list[str], where: str) -> None:
    if not args:
        return
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "hostreduce":
            _check_hostreduce(rest, where)
        else:
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
            _check_paths(rest, where)
    elif args[0] == "-c":
        compile(args[1], where, "exec")
    elif "/" in args[0]:                       # a repository script (a bare name is the user's)
        script = ROOT / args[0]
        assert script.is_file(), f"{where}: {args[0]} does not exist"
        _check_script_options(script, args[1:], where)


def _check_command(tokens: list[str], where: str) -> None:
    while tokens and ASSIGNMENT.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return
    program = os.path.basename(tokens[0])
    args = tokens[1:]
    _check_paths(tokens, where)
    if program == "hostreduce":
        _check_hostreduce(args, where)
    elif re.fullmatch(r"python(3(\.\d+)?)?", program):
        _check_python(args, where)
    elif program == "bash" and args and not args[0].startswith("-"):
        script = ROOT / args[0]
        assert script.is_file(), f"{where}: {args[0]} does not exist"
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, f"{where}: bash -n {args[0]}: {res.stderr}"
    elif program == "mpirun":
        i = 0
        while i < len(args) and args[i].startswith("-"):
            i += 2 if args[i] in ("-np", "-n", "-x", "-H", "--host", "--hostfile", "-hostfile") else 1
        if i < len(args):
            _check_command(args[i:], where)


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_command_lines_name_what_exists(block):
    for tokens in _command_lines(block.source):
        _check_command(tokens, block.id)


def test_quick_start_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in QUICK_START:
        assert re.search(rf"^{re.escape(command)}(\s|$)", readme, re.M), f"README.md lost `{command}`"
        script = ROOT / command.split()[1]
        assert script.is_file(), script
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# --- Python blocks ---------------------------------------------------------------------

@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_blocks_compile(block):
    compile(block.source, block.id, "exec")


# --- runnable blocks -------------------------------------------------------------------

def _env() -> dict[str, str]:
    """The environment of a user in a fresh shell of this checkout: this tree's package
    first, the environment's programs (hostreduce, python) on PATH, no job settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    needs_tf = re.search(r"\bimport tensorflow\b|hostreduce\.(horovod|distribute|hccl)\b|\bkeras\b", block.source)
    return [pytest.mark.tf] if needs_tf else []


def test_some_blocks_are_runnable():
    assert {b.lang for b in RUNNABLE} >= {"python", "bash"}, "the runnable marker is no longer found"


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=b.id) for b in RUNNABLE])
def test_runnable_blocks_run(block):
    if block.lang == "python":
        command = [sys.executable, "-c", block.source]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.source]
    try:
        res = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish in {RUN_TIMEOUT_S} s; output: {exc.stdout!r} {exc.stderr!r}")
    assert res.returncode == 0, f"{block.id} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


# --- links -------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    anchors, seen, in_code = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        heading = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(anchors)


def _links(path: Path) -> Iterator[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)     # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)                           # nor inline code
    yield from re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=[d.relative_to(ROOT).as_posix() for d in DOCUMENTS])
def test_links_resolve(doc):
    for target in _links(doc):
        if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        assert dest.exists(), f"{doc.relative_to(ROOT)}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), (
                f"{doc.relative_to(ROOT)}: link to {target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
