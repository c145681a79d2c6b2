"""Package layout: what importing costs (no torch for the planner and the CLI's help), strategy-name
registration in either import order, profiling rooms free of the reference models, DeepSpeed
optional at SP 1, and the plan file's mode.

The import checks run in fresh subprocesses and look at ``sys.modules``; nothing here is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "deepspeed")


def _python(code: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


def _loaded_after(setup: str) -> list[str]:
    """Which of torch / lightning / deepspeed / matplotlib ``setup`` leaves in ``sys.modules``."""
    watched = HEAVY + ("matplotlib",)
    return json.loads(_python("import contextlib, io, json, sys\n" + textwrap.dedent(setup) + "\n"
                              f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"))


def _cli(argv: list[str]) -> str:
    return textwrap.dedent(f"""
        from lightning_dcp import cli
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main({argv!r})
            except SystemExit as e:
                code = e.code
        assert code == 0, code
    """)


def test_importing_the_package_loads_no_torch():
    assert _loaded_after("import lightning_dcp; lightning_dcp.__version__; import lightning_dcp.planning") == []


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["simulate", "--help"], ["train", "--help"],
                                  ["profile", "--help"], ["encode", "--help"], ["budget", "--help"]])
def test_cli_help_imports_neither_torch_nor_lightning(argv):
    assert _loaded_after(_cli(argv)) == []


def test_cli_plan_and_simulate_import_neither_torch_nor_lightning(tmp_path):
    """``plan --shuffle`` (the default) draws the sampler's own permutation, ``torch.randperm``: torch, never lightning."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([2048, 4096, 1024, 30000, 8000] * 4))
    plan = ["plan", "--lengths", str(lengths), "--out", str(tmp_path / "plan.json"), "--world-size", "4", "--no-drop-last"]
    simulate = ["simulate", "--lengths", str(lengths), "--world-size", "4", "--num-steps", "1", "--policies", "dcp,static"]
    assert [m for m in _loaded_after(_cli(plan + ["--no-shuffle"])) if m in HEAVY] == []
    assert [m for m in _loaded_after(_cli(plan)) if m in HEAVY] == ["torch"]
    assert [m for m in _loaded_after(_cli(simulate)) if m in HEAVY] == []


def test_profiling_rooms_import_neither_models_nor_data():
    out = _python("""
        import sys
        import lightning_dcp.profiling.callback, lightning_dcp.profiling.assemble, lightning_dcp.profiling.cache
        print(sorted(m for m in ("lightning_dcp.models", "lightning_dcp.data", "lightning_dcp.runtime.strategy") if m in sys.modules))
    """)
    assert out == "[]"


@pytest.mark.parametrize("first", ["lightning_dcp", "lightning.pytorch"])
def test_strategy_names_registered_whatever_the_import_order(first):
    second = "lightning.pytorch" if first == "lightning_dcp" else "lightning_dcp"
    out = _python(f"""
        import {first}
        import {second}
        from lightning.pytorch.strategies import StrategyRegistry
        from lightning_dcp import DCPStrategy
        dcp, spawn = StrategyRegistry.get("dcp"), StrategyRegistry.get("dcp_spawn")
        assert isinstance(dcp, DCPStrategy) and isinstance(spawn, DCPStrategy)
        print(dcp._start_method, spawn._start_method)
    """)
    assert out == "popen spawn"


def test_installed_wheel_registers_dcp_without_an_import(tmp_path):
    """``pip install lightning-dcp`` puts a ``.pth`` line in site-packages: ``strategy="dcp"`` works in a
    script that never imports lightning_dcp; start-up imports neither torch, Lightning nor the package itself
    (so a source checkout earlier on ``sys.path`` still provides the package)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    import zipfile

    (wheel,) = tmp_path.glob("lightning_dcp-*.whl")
    site_dir = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        assert [n for n in zf.namelist() if n.endswith(".pth")] == ["lightning_dcp_strategies.pth"]
        zf.extractall(site_dir)  # what pip puts in site-packages
    out = _python(f"""
        import json, site, sys
        site.addsitedir({str(site_dir)!r})  # what the interpreter does with site-packages at start-up
        at_start = sorted(m for m in {HEAVY!r} + ("lightning_dcp",) if m in sys.modules)
        import lightning.pytorch as pl
        trainer = pl.Trainer(strategy="dcp", accelerator="cpu", devices=1, logger=False)
        import lightning_dcp
        print(json.dumps([at_start, type(trainer.strategy).__name__, lightning_dcp.__file__.startswith({str(ROOT)!r})]))
    """)
    assert json.loads(out) == [[], "DCPStrategy", True]


def test_editable_install_registers_dcp_without_an_import(tmp_path):
    """``pip install -e .`` (what ``scripts/setup.sh`` does) installs the ``.pth`` line too: a real editable
    install into a throwaway venv that sees this interpreter's site-packages (torch, Lightning, setuptools) but not
    the source tree; a script there that never imports lightning_dcp gets ``Trainer(strategy="dcp")``, and the
    package it then imports is the editable one."""
    import site

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True,
                   timeout=120)
    python = venv / "bin" / "python"
    venv_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    (venv_site / "_parent_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")  # paths only: no hooks
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--ignore-installed", "--no-deps",
                              "--no-build-isolation", "-e", str(ROOT)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert (venv_site / "lightning_dcp_strategies.pth").is_file(), sorted(p.name for p in venv_site.iterdir())
    script = textwrap.dedent(f"""
        import json, sys
        at_start = sorted(m for m in {HEAVY!r} + ("lightning_dcp",) if m in sys.modules)
        import lightning.pytorch as pl
        trainer = pl.Trainer(strategy="dcp", accelerator="cpu", devices=1, logger=False)
        import lightning_dcp
        print(json.dumps([at_start, type(trainer.strategy).__name__, lightning_dcp.__file__.startswith({str(ROOT)!r})]))
    """)
    run = subprocess.run([str(python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [[], "DCPStrategy", True]


def test_without_deepspeed_the_package_imports_and_trains_at_sp1():
    out = _python("""
        import sys
        sys.modules["deepspeed"] = None  # as if not installed: any import of it raises ImportError
        import lightning.pytorch as pl, torch
        from torch.utils.data import DataLoader
        import lightning_dcp
        from lightning_dcp import DCPStrategy
        from lightning_dcp.sp import ulysses
        from lightning_dcp.data import SyntheticTokenDataset, plain_collate
        from lightning_dcp.models.module import DCPTransformerModule

        torch.set_num_threads(1)
        torch.manual_seed(0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DCPStrategy(global_batch_size=4, profile=False),
                             max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(DCPTransformerModule("tiny-1d"), DataLoader(SyntheticTokenDataset(num_samples=8), batch_size=1,
                                                                collate_fn=plain_collate))
        assert trainer.global_step == 1
        try:
            ulysses._seq_all_to_all_op()
        except ImportError as err:
            assert "pip install 'deepspeed>=0.15,<0.20'" in str(err) and "max_sp_size=1" in str(err), err
        else:
            raise AssertionError("no ImportError without deepspeed")
        print("ok", trainer.global_step)
    """, timeout=600)
    assert out == "ok 1"


def test_deepspeed_without_seq_all_to_all_names_the_supported_range(monkeypatch):
    import types

    from lightning_dcp.sp import ulysses

    fake = types.ModuleType("deepspeed")
    fake.__path__ = []  # a package without deepspeed.sequence
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    for name in ("deepspeed.sequence", "deepspeed.sequence.layer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=r"deepspeed.sequence.layer from DeepSpeed>=0.15,<0.20.*installed deepspeed"):
        ulysses._seq_all_to_all_op()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_plan_file_mode_follows_the_umask(tmp_path, umask, mode):
    from lightning_dcp.commands.plan import write_atomic

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "plan.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "plan.json").stat().st_mode & 0o777 == mode


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_module_and_function_sizes():
    """House rule (issue #24): no module in ``lightning_dcp/`` over 600 lines, no function over 80 lines.

    A function's size runs from its ``def`` line to its last line (docstring and comments included).
    Fails listing every offender, with its size, so a long file or function shows up in review.
    """
    import ast

    offenders = []
    for path in sorted((ROOT / "lightning_dcp").rglob("*.py")):
        source = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            offenders.append(f"{rel}: {lines} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    offenders.append(f"{rel}:{node.lineno} {node.name}: {size} lines (max {MAX_FUNCTION_LINES})")
    assert not offenders, "split these into well-named pieces:\n" + "\n".join(offenders)
