"""Every shell command in README.md and docs/*.md is checked; the short ones run as written.

- :data:`RUN`: fast ``lightning-dcp`` commands, run in-process (``cli.main``) in a scratch folder holding the
  ``lengths.json`` they name, in the order written here (``budget --profile profile.json`` reads the profile
  the ``profile`` command before it writes). Each must exit 0, and each must still be in the docs.
- Every other ``lightning-dcp`` command is parsed by the CLI's own argparse parser (the command exists and
  takes those flags); a bare ``lightning-dcp NAME`` in prose must name a command.
- ``python benchmarks/X.py`` / ``python examples/X.py``: the script exists and declares every ``--flag``
  used (read from its ``add_argument`` calls; after a bare ``--``, from the script it passes them on to).
- ``pip install "lightning-dcp[extra]"``: the extra is in pyproject.toml; ``pytest -m M``: a declared marker.
- :data:`EXTERNAL`: other programs, named here so that a new kind of command must be added on purpose.

Relative links in the same files must name files that exist, and ``#anchors`` headings that exist.

The "Lightning features" table of docs/strategy.md: every row names the tests that back it
(``tests/FILE.py::test_name``), and each named test is a test function of that file.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import pytest

import lightning_dcp.cli as cli
from _docs import ROOT, DocCommand, all_commands, anchors, doc_files, links

RUN = [
    "lightning-dcp plan --lengths lengths.json --world-size 32 --model transformer-1d --hardware h100 --policy dcp --global-batch-tokens 65536 --out plan.json",
    "lightning-dcp simulate",
    "lightning-dcp simulate --model llama-7b --sharding fsdp",
    "lightning-dcp simulate --rank-speed 0-7:0.7",
    "lightning-dcp simulate --model wan-1.3b --dataset wan --global-batch-tokens 2097152 --num-steps 4",
    "lightning-dcp profile --model tiny-1d --out profile.json",
    "lightning-dcp budget --profile profile.json --lengths lengths.json --world-size 8",
]
"""Commands run as written (about 15 s together, most of it profiling tiny-1d)."""

PRODUCES = {"profile.json": "lightning-dcp profile --model tiny-1d --out profile.json"}
"""Files a command of :data:`RUN` reads, and the command of :data:`RUN` that writes them."""

EXTERNAL = {"torchrun", "sbatch"}
"""Programs outside this repository: their commands are listed, not checked."""

PASSTHROUGH = {"benchmarks/slow_rank_run.py": "benchmarks/run.py"}
"""Scripts that hand the flags after ``--`` to another script."""

COMMANDS = all_commands()


def _id(cmd: DocCommand) -> str:
    return f"{cmd.source} {cmd.text[:60]}"


@cache
def _parser():
    return cli.build_parser()


@cache
def _script_flags(rel: str) -> frozenset[str]:
    tree = ast.parse((ROOT / rel).read_text())
    return frozenset(arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and getattr(node.func, "attr", None) == "add_argument"
                     for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"))


def _check_lightning_dcp(cmd: DocCommand, argv: list[str]) -> None:
    if cmd.inline and len(argv) == 1:    # prose naming a command: `lightning-dcp encode`
        assert argv[0] in cli.COMMANDS, f"{cmd.source}: `lightning-dcp {argv[0]}` is not a command ({sorted(cli.COMMANDS)})"
        return
    try:
        _parser().parse_args(argv)
    except SystemExit as err:  # argparse's error exit
        pytest.fail(f"{cmd.source}: `{cmd.text}` does not parse (exit {err.code})")


def _check_script(cmd: DocCommand, argv: list[str]) -> None:
    if argv[0] == "time":
        argv = argv[1:]
    if argv[0] == "taskset":             # taskset -c CPUS python ...
        argv = argv[3:]
    assert argv[0] == "python", cmd
    script = argv[1]
    assert (ROOT / script).is_file(), f"{cmd.source}: {script} does not exist"
    target = script
    for word in argv[2:]:
        if word == "--":
            target = PASSTHROUGH[script]
            continue
        if word.startswith("--"):
            flag = word.split("=")[0]
            assert flag in _script_flags(target), f"{cmd.source}: {target} has no {flag} ({sorted(_script_flags(target))})"


def _check_pip(cmd: DocCommand, argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in argv[2:]:
        m = re.fullmatch(r"lightning-dcp\[([\w,-]+)\]", word)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"{cmd.source}: pyproject.toml has no extra {extra!r} ({sorted(extras)})"


def _check_pytest(cmd: DocCommand, argv: list[str]) -> None:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    declared = {m.split(":")[0] for m in markers}
    for flag, value in zip(argv[3:], argv[4:]):     # after `.venv/bin/python -m pytest`
        if flag == "-m":
            assert value.removeprefix("not ") in declared, f"{cmd.source}: no pytest marker {value!r}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_every_documented_command_exists_and_parses(cmd):
    argv = cmd.argv
    program = argv[0]
    if program in ("lightning-dcp", ".venv/bin/lightning-dcp"):
        _check_lightning_dcp(cmd, argv[1:])
    elif program in ("python", "time", "taskset"):
        _check_script(cmd, argv)
    elif program == "pip":
        _check_pip(cmd, argv)
    elif program == ".venv/bin/python" and argv[1:3] == ["-m", "pytest"]:
        _check_pytest(cmd, argv)
    elif program == "bash":
        assert (ROOT / argv[1]).is_file(), f"{cmd.source}: {argv[1]} does not exist"
    else:
        assert program in EXTERNAL, f"{cmd.source}: `{cmd.text}`: add {program!r} to a check or to EXTERNAL"


def test_the_quick_start_and_ci_commands_are_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for line in ("bash scripts/setup.sh && .venv/bin/lightning-dcp train",
                 "bash scripts/setup.sh && .venv/bin/python -m pytest -q"):
        assert line in readme
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_the_run_list_is_written_in_the_docs():
    written = {cmd.text for cmd in COMMANDS}
    assert [c for c in RUN if c not in written] == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs")
    (path / "lengths.json").write_text(json.dumps([512, 1024, 2048, 4096, 300, 128, 8192, 700] * 8))
    return path


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("text", RUN)
def test_short_documented_commands_run_as_written(text, workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("LIGHTNING_DCP_CACHE", str(workdir / "cache"))
    for name, producer in PRODUCES.items():   # run alone (-k), a command still finds the file it reads
        if f"--profile {name}" in text and not (workdir / name).exists():
            assert cli.main(shlex.split(producer)[1:]) == 0
    code = cli.main(shlex.split(text)[1:])
    out = capsys.readouterr()
    assert code == 0, f"`{text}` exited {code}: {out.err[-2000:]}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings_that_exist(path):
    bad = []
    for target, source in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{source}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{source}: {target} (no heading #{anchor} in {dest.name})")
    assert bad == []


FEATURES_DOC = ROOT / "docs" / "strategy.md"
_NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def _feature_rows() -> list[list[str]]:
    """The cells of each body row of the "Lightning features" table."""
    text = FEATURES_DOC.read_text()
    assert "\n## Lightning features\n" in text, f"{FEATURES_DOC.name} has no 'Lightning features' section"
    section = text.split("\n## Lightning features\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table[0].replace(" ", "") == "|Feature|WorksasinDDP|Notes|" and set(table[1]) <= set("|-"), table[:2]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table[2:]]


@cache
def _test_functions(rel: str) -> frozenset[str]:
    tree = ast.parse((ROOT / rel).read_text())
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and node.name.startswith("test_"))


def test_every_lightning_feature_row_names_tests_that_exist():
    rows = _feature_rows()
    assert len(rows) >= 20, [r[0] for r in rows]  # the features of issue #35, one row each
    bad = []
    for cells in rows:
        assert len(cells) == 3 and all(cells), cells
        named = _NAMED_TEST.findall(cells[2])
        if not named:
            bad.append(f"{cells[0]}: names no test")
        for rel, name in named:
            if not (ROOT / rel).is_file():
                bad.append(f"{cells[0]}: {rel} does not exist")
            elif name not in _test_functions(rel):
                bad.append(f"{cells[0]}: {rel} has no test function {name}")
    assert bad == []
