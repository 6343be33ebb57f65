"""Every command and code block in README.md and docs/*.md is checked, so the docs cannot drift.

Each fenced block tagged bash, sh, console, shell or python is one test, named by its file
and line:

- `shoal ...`, `bin/shoal ...` and `python -m shoal ...` are parsed by shoal's real argument
  parser (a flag that does not exist or a value that does not parse fails);
- `.venv/bin/python benchmarks/X.py ...` is parsed by the script's own `build_parser()`
  (a bare `python` fails: it lacks the project's packages);
- `pytest ...` collects the tests it names; `bin/test` must exist (it runs the whole suite);
- `curl ...` is sent to a real `shoal serve` of the tiny test model;
- python blocks are compiled and run, on CPU, with the tiny test model in place of the
  model the doc names.

A block opts out only with a marker on the line before it, which the test reports as a
skip: `<!-- doc-check: skip (why) -->` (not checked at all) or, for python,
`<!-- doc-check: compile-only (why) -->` (compiled, not run).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "console", "shell"}
MARKER = re.compile(r"<!--\s*doc-check:\s*(skip|compile-only)\s*\((.+?)\)\s*-->")
# model names the docs use, replaced by the tiny test model's folder when a block runs
MODEL_NAMES = ("Qwen/Qwen3-0.6B", "path/to/model")
SERVED_NAME = "tiny"  # serve_helpers.start_serve's --served-model-name
PYTHONS = {".venv/bin/python", ".venv/bin/python3"}
SHOALS = {"shoal", "bin/shoal", ".venv/bin/shoal"}
PYTESTS = {"pytest", ".venv/bin/pytest"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its opt-out marker."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: tuple[str, str] | None  # (skip | compile-only, reason)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a markdown file, with the marker on the line before each."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence.group(1)):
            end += 1
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        yield Block(
            path,
            i + 1,
            fence.group(2).lower(),
            "\n".join(lines[i + 1 : end]),
            (marker.group(1), marker.group(2)) if marker else None,
        )
        i = end + 1


ALL_BLOCKS = [b for path in DOCS for b in blocks(path)]
CHECKED = [b for b in ALL_BLOCKS if b.lang in SHELL | {"python"}]


# ---- shell commands ---------------------------------------------------------------------


def commands(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line offset, argv) of each command in a shell block: continuations joined, comments
    dropped, split at `&&`, `||`, `;`, `|` and a trailing `&`."""
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for n, line in enumerate(text.splitlines()):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((start, pending + line))
        pending = ""
    for offset, line in logical:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token in {"&&", "||", ";", "|", "&"}:
                if argv:
                    yield offset, argv
                argv = []
            else:
                argv.append(token)


def strip_prefixes(argv: list[str], env: dict[str, str]) -> list[str]:
    """The command behind `VAR=value`, `env [-u VAR] [VAR=value]` and `taskset -c CPUS`;
    the variables it sets go into `env`."""
    while argv:
        if re.match(r"^[A-Za-z_]\w*=", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        elif argv[0] == "env":
            argv.pop(0)
            while argv and (argv[0] == "-u" or "=" in argv[0]):
                if argv.pop(0) == "-u":
                    env.pop(argv.pop(0), None)
                else:
                    continue
        elif argv[0] == "taskset" and len(argv) > 2 and argv[1] == "-c":
            del argv[:3]
        else:
            return argv
    return argv


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` on top, restored afterwards (parsers read env twins)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_with(build: Callable, argv: list[str], what: str) -> None:
    """Parse `argv` with the parser `build()` returns; AssertionError with argparse's words."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build().parse_args(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                said = err.getvalue().strip().splitlines() or [f"exit status {e.code}"]
                raise AssertionError(f"{what}: {said[-1]}") from None


def shoal_parser():
    """The `shoal` command's real parser (one place to point at a new CLI entry point)."""
    from shoal.cli import build_parser

    return build_parser()


def script_parser(script: Path) -> Callable:
    """A benchmark script's build_parser, imported from its file."""
    spec = importlib.util.spec_from_file_location(f"doc_check_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert hasattr(module, "build_parser"), f"{script.name} has no build_parser()"
    return module.build_parser


def check_command(argv: list[str], env: dict[str, str], server: Callable[[], str]) -> None:
    """Check one command as the module docstring says; AssertionError when it is wrong."""
    argv = strip_prefixes(argv, env)
    if not argv:
        return
    prog, args = argv[0], argv[1:]
    if prog == "export":
        for assignment in args:
            name, _, value = assignment.partition("=")
            env[name] = value
        return
    if prog in PYTHONS and args[:2] == ["-m", "shoal"]:
        prog, args = "shoal", args[2:]
    if prog in SHOALS:
        with environment(env):
            parse_with(shoal_parser, args, "shoal " + " ".join(args))
    elif prog in PYTHONS | {"python", "python3"} and args and args[0].startswith("benchmarks/"):
        assert prog in PYTHONS, f"{prog} {args[0]}: use .venv/bin/python (the project's venv)"
        script = ROOT / args[0]
        assert script.is_file(), f"{args[0]} does not exist"
        with environment(env):
            parse_with(script_parser(script), args[1:], " ".join(args))
    elif prog in PYTESTS:
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        out = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, f"pytest {' '.join(args)}:\n{out.stdout[-2000:]}"
    elif prog == "bin/test":
        assert os.access(ROOT / "bin" / "test", os.X_OK), "bin/test is missing"
    elif prog == "curl":
        send_curl(args, server())
    else:
        raise AssertionError(f"no check for {prog!r}: mark the block doc-check: skip (why)")


def send_curl(args: list[str], base: str) -> None:
    """Send a curl command's request to `base` (its model renamed to the served one)."""
    headers, data, url = {}, None, None
    it = iter(args)
    for arg in it:
        if arg in ("-H", "--header"):
            name, _, value = next(it).partition(":")
            headers[name.strip()] = value.strip()
        elif arg in ("-d", "--data", "--data-raw"):
            data = json.loads(next(it))
        elif not arg.startswith("-"):
            url = arg
    assert url, "curl without a URL"
    target = re.sub(r"^https?://[^/]+", base, url)
    if data is None:
        response = httpx.get(target, headers=headers, timeout=60)
    else:
        data["model"] = SERVED_NAME
        response = httpx.post(target, headers=headers, json=data, timeout=60)
    assert response.status_code == 200, f"curl {url}: {response.status_code} {response.text}"


# ---- python blocks ----------------------------------------------------------------------


def run_python(source: str, model: Path) -> None:
    """Run a python block in a fresh interpreter, the tiny model in place of the doc's."""
    for name in MODEL_NAMES:
        source = source.replace(name, str(model))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]


# ---- tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doc_model(tmp_path_factory) -> Path:
    """The tiny llama with the 4,096-token context the docs' examples ask for."""
    from tiny_models import write_model

    return write_model(tmp_path_factory.mktemp("doc-model"), "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(doc_model: Path, tmp_path_factory) -> Iterator[Callable[[], str]]:
    """A `shoal serve` of the tiny model, started the first time a block needs it."""
    sys.path.insert(0, str(ROOT / "tests" / "serving"))
    from serve_helpers import start_serve, stop_serve

    started: list = []

    def url() -> str:
        if not started:
            started.append(start_serve(doc_model, tmp_path_factory.mktemp("doc-serve"), 1))
        return started[0][1]

    yield url
    if started:
        stop_serve(started[0][0])


def test_docs_have_blocks_and_every_marker_has_a_block() -> None:
    assert len(CHECKED) >= 20, [b.where for b in CHECKED]
    for path in DOCS:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if "doc-check" in line:
                assert MARKER.search(line), f"{path.name}:{n + 1}: unreadable marker {line!r}"
                after = next((m for m in lines[n + 1 :] if m.strip()), "")
                assert after.lstrip().startswith("```"), f"{path.name}:{n + 1}: no block follows"


@pytest.mark.parametrize("block", CHECKED, ids=[b.where for b in CHECKED])
def test_doc_block(block: Block, doc_model: Path, server: Callable[[], str]) -> None:
    kind, reason = block.marker or ("", "")
    if kind == "skip":
        pytest.skip(f"{block.where}: {reason}")
    if block.lang == "python":
        try:
            compile(block.text, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as e:
            pytest.fail(f"{block.where}: {e}")
        if kind == "compile-only":
            pytest.skip(f"{block.where}: compiled only ({reason})")
        run_python(block.text, doc_model)
        return
    assert kind != "compile-only", f"{block.where}: compile-only is for python blocks"
    env: dict[str, str] = {}
    for offset, argv in commands(block.text):
        try:
            check_command(argv, env, server)
        except AssertionError as e:
            pytest.fail(f"{block.path.relative_to(ROOT)}:{block.line + 1 + offset}: {e}")
