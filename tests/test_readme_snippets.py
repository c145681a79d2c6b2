"""The README's Python snippets run as written: each ```python block of README.md is saved as a script and run in a
fresh process (offline, on CPU here: the snippets pick the device themselves), in a folder holding what it reads.

The short one (your own LightningModule in safe mode) runs in the default suite; the Hugging Face causal LM and the
diffusers video model (it trains on a tiny-wan encode of generated clips, made here first) are ``slow``. Every
snippet bounds its run (``max_steps``: Lightning's default is 1000 epochs) and is one of the cases below, so a new
snippet needs a case here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: A word each snippet is known by -> whether its run is slow (multi-second imports, a profile and 20 steps).
CASES = {"BoringModel": False, "CausalLMModule": True, "EncodedVideoDataset": True}


def readme_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _snippet(word: str) -> str:
    found = [s for s in readme_snippets() if word in s]
    assert len(found) == 1, f"README.md has {len(found)} Python snippets using {word}"
    return found[0]


def test_every_readme_snippet_is_run_here_and_bounds_its_run():
    snippets = readme_snippets()
    assert len(snippets) == len(CASES)
    for text in snippets:
        assert [w for w in CASES if w in text], f"a README snippet this file does not run:\n{text}"
        assert "max_steps=" in text, f"a README snippet without max_steps trains Lightning's 1000 epochs:\n{text}"


def _run(text: str, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "snippet.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               LIGHTNING_DCP_CACHE=str(cwd / "profiles"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "`Trainer.fit` stopped: `max_steps=20` reached." in done.stdout + done.stderr


def test_your_own_module_snippet_runs_as_written(tmp_path):
    _check(_run(_snippet("BoringModel"), tmp_path))


@pytest.mark.slow
def test_the_causal_lm_snippet_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    _check(_run(_snippet("CausalLMModule"), tmp_path))


@pytest.mark.slow
def test_the_video_snippet_runs_as_written_on_a_tiny_wan_encode(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    from _encode_helpers import make_videos

    from lightning_dcp.cli import main

    make_videos(tmp_path / "clips")
    assert main(["encode", "--videos", str(tmp_path / "clips"), "--captions", str(tmp_path / "clips/captions.csv"),
                 "--model", "tiny-wan", "--out", str(tmp_path / "encoded"), "--no-progress"]) == 0
    _check(_run(_snippet("EncodedVideoDataset"), tmp_path))
