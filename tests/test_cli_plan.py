"""CLI: ``lightning-dcp plan`` / ``simulate`` happy paths and errors (exit 2, nothing written)."""

from __future__ import annotations

import json

import pytest

import lightning_dcp.cli as cli
from lightning_dcp.planning.plan import Plan
from lightning_dcp.planning.checks import validate_plan


@pytest.fixture(autouse=True)
def only_planning_commands(monkeypatch):
    # the CLI imports every command module; keep these tests independent of the others
    monkeypatch.setattr(cli, "COMMANDS", {k: v for k, v in cli.COMMANDS.items() if k in ("plan", "simulate")})


def write(tmp_path, data, name="lengths.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def run_plan(tmp_path, lengths_file, *extra):
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--lengths", str(lengths_file), "--out", str(out), *extra])
    return code, out


def test_plan_writes_valid_plan(tmp_path, capsys):
    lengths = [2048, 4096, 1024, 30000, 150000, 8000] * 10
    code, out = run_plan(tmp_path, write(tmp_path, lengths), "--world-size", "8", "--policy", "dcp",
                         "--global-batch-tokens", "400000", "--no-drop-last")
    assert code == 0
    plan = Plan.from_json(out.read_text())
    validate_plan(plan, lengths, samples=range(len(lengths)))
    assert plan.policy == "dcp" and plan.world_size == 8
    assert "wrote" in capsys.readouterr().out


def test_plan_cuts_each_epoch_as_the_sampler_does(tmp_path, capsys):
    """Default --shuffle --drop-last: each epoch's steps are the sampler's global batches of that epoch (seeded
    seed + epoch, the last incomplete one left out), in order, planned as its step keys."""
    from lightning_dcp.runtime.sampler import DCPBatchSampler

    lengths = [2048, 4096, 1024, 30000, 150000, 8000] * 10
    code, out = run_plan(tmp_path, write(tmp_path, lengths), "--world-size", "8", "--global-batch-tokens", "400000",
                         "--seed", "3", "--epochs", "2")
    assert code == 0 and "samples in incomplete last batches dropped" in capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    sampler = DCPBatchSampler(lengths, planner=None, global_batch_tokens=400000, seed=3)
    expected = [sorted(b) for e in (0, 1) for b in sampler.global_batches(e)]
    assert [sorted(step.samples) for step in plan.steps] == expected
    assert plan.extra["epoch_steps"] == [len(sampler.global_batches(0)), len(sampler.global_batches(1))]
    assert sampler.left_out(0) > 0 and expected[0] != sorted(range(len(expected[0])))  # shuffled, tail dropped


def test_plan_seed_default_is_the_seed_a_fit_trains_with(tmp_path, capsys, monkeypatch):
    """No --seed: ``plan`` reads the seed ``DCPStrategy(seed=None)`` resolves (``seed_everything`` sets
    ``PL_GLOBAL_SEED``), so its steps are the batches the fit's sampler draws -- not seed 0's."""
    from lightning_dcp.planning.seed import data_seed
    from lightning_dcp.runtime.sampler import DCPBatchSampler
    from lightning_dcp.runtime.settings import DCPSettings

    lengths = [2048, 4096, 1024, 30000, 150000, 8000] * 10
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    code, out = run_plan(tmp_path, write(tmp_path, lengths), "--world-size", "8", "--global-batch-tokens", "400000")
    assert code == 0
    plan = Plan.from_json(out.read_text())
    trained = DCPSettings().data_seed
    assert trained == 7 and plan.extra["seed"] == 7
    batches = lambda seed: [sorted(b) for b in DCPBatchSampler(lengths, planner=None, global_batch_tokens=400000,
                                                                seed=seed).global_batches(0)]
    assert [sorted(step.samples) for step in plan.steps] == batches(trained) != batches(0)
    assert data_seed(3) == 3  # an explicit seed wins
    monkeypatch.setenv("PL_GLOBAL_SEED", "x7")
    code, _ = run_plan(tmp_path, write(tmp_path, lengths), "--world-size", "8")
    assert code == 2 and "$PL_GLOBAL_SEED='x7' is not an integer seed" in capsys.readouterr().err
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert DCPSettings().data_seed == 0 and DCPSettings(seed=5).data_seed == 5


def test_plan_with_no_full_global_batch_says_how_to_get_one(tmp_path, capsys):
    code, out = run_plan(tmp_path, write(tmp_path, [100, 200]), "--world-size", "8", "--global-batch-tokens", "1000")
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and "no full global batch of 1000 tokens" in err and "--no-drop-last" in err


@pytest.mark.parametrize("content,needle", [
    ("[]", "empty"),
    ("[1, 0, 3]", "lengths.json[1] is 0; every sample needs >= 1 token"),
    ("[5, -2]", "lengths.json[1] is -2"),
    ("[1.5]", "lengths.json[0] is 1.5, not an integer"),
    ('{"a": 1}', "JSON list"),
    ("[1, 2", "not valid JSON"),
    ("[1, \"x\"]", "lengths.json[1] is 'x' (str), not an integer"),
])
def test_bad_lengths_file(tmp_path, capsys, content, needle):
    code, out = run_plan(tmp_path, write(tmp_path, content), "--world-size", "8")
    assert code == 2 and not out.exists()
    assert needle in capsys.readouterr().err


def test_missing_lengths_file(tmp_path, capsys):
    code, out = run_plan(tmp_path, tmp_path / "nope.json", "--world-size", "8")
    assert code == 2 and not out.exists() and "cannot read" in capsys.readouterr().err


def test_python_m_reports_user_errors_cleanly(tmp_path):
    """``python -m lightning_dcp.cli``: a user error is one line and exit code 2, as with the script."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "lightning_dcp.cli", "plan", "--lengths", str(tmp_path / "nope.json"),
                           "--world-size", "8", "--out", str(tmp_path / "plan.json")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "cannot read" in proc.stderr, proc.stderr


def test_sample_too_long(tmp_path, capsys):
    code, out = run_plan(tmp_path, write(tmp_path, [1000, 5_000_000]), "--world-size", "8")
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "sample 1" in err and "5000000" in err and "longest that fits" in err


@pytest.mark.parametrize("flag,value,needle", [
    ("--model", "gpt-17", "unknown model"),
    ("--hardware", "tpu9", "unknown hardware"),
    ("--policy", "fastest", "unknown policy"),
    ("--world-size", "0", "positive"),
    ("--global-batch-tokens", "-5", "positive"),
])
def test_unknown_names(tmp_path, capsys, flag, value, needle):
    args = ["--world-size", "8", flag, value] if flag != "--world-size" else [flag, value]
    code, out = run_plan(tmp_path, write(tmp_path, [100, 200]), *args)
    assert code == 2 and not out.exists() and needle in capsys.readouterr().err


def test_bad_profile(tmp_path, capsys):
    prof = write(tmp_path, "{}", "profile.json")
    code, out = run_plan(tmp_path, write(tmp_path, [100]), "--world-size", "8", "--profile", str(prof))
    assert code == 2 and not out.exists() and "profile" in capsys.readouterr().err


def test_non_power_of_two_world(tmp_path):
    code, out = run_plan(tmp_path, write(tmp_path, [1000, 2000, 120000, 300] * 4), "--world-size", "6")
    assert code == 0
    plan = Plan.from_json(out.read_text())
    ranks = {r for s in plan.steps for i in s.items for r in i.ranks}
    assert ranks <= set(range(6))


def test_simulate_table_json_csv_plot(tmp_path, capsys):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "g.png"
    code = cli.main(["simulate", "--world-size", "8", "--dataset", "short", "--num-steps", "2",
                     "--global-batch-tokens", "2000000", "--policies", "bucket,static,dcp",
                     "--json", str(js), "--csv", str(cs), "--plot", str(png)])
    assert code == 0
    out, err = capsys.readouterr()
    assert "speedup" in out and "dcp" in out
    rows = json.loads(js.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["bucket", "static", "dcp"] and rows[0]["speedup"] == 1.0
    assert cs.read_text().startswith("policy,") and png.read_bytes()[:4] == b"\x89PNG"
    assert "[1/3] bucket" in err and "[3/3] dcp" in err and "drew" in err  # progress, one line per phase


def test_simulate_plot_works_without_the_hatchcolor_keyword(tmp_path, monkeypatch):
    """``--plot`` runs on every supported matplotlib (>= 3.7): the ``hatchcolor`` keyword (3.11+) is
    refused here as older versions refuse it, and the recompute hatch still comes out black and drawn
    (matplotlib < 3.11 draws nothing for a collection whose face and edge are both "none")."""
    import matplotlib.collections as mc

    hatched = []

    class OldPolyCollection(mc.PolyCollection):
        def __init__(self, *args, **kwargs):
            if "hatchcolor" in kwargs:
                raise TypeError("PolyCollection.set() got an unexpected keyword argument 'hatchcolor'")
            super().__init__(*args, **kwargs)
            if kwargs.get("hatch"):
                hatched.append(self)

    monkeypatch.setattr(mc, "PolyCollection", OldPolyCollection)
    png = tmp_path / "g.png"
    assert cli.main(["simulate", "--world-size", "8", "--dataset", "long", "--num-steps", "1", "--policies", "dcp",
                     "--plot", str(png), "--quiet"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and hatched  # the long dataset recomputes somewhere
    for c in hatched:
        colour = c.get_hatchcolor() if hasattr(c, "get_hatchcolor") else [c._hatch_color]
        assert [tuple(x) for x in colour] == [(0.0, 0.0, 0.0, 1.0)]
        assert len(c.get_facecolor()) > 0  # a (transparent) face, so old matplotlib draws the hatch


def test_simulate_runs_with_no_arguments_and_says_which_defaults(capsys):
    assert cli.main(["simulate"]) == 0
    cap = capsys.readouterr()
    assert "using defaults --world-size 32 --dataset long" in cap.out
    assert "32 GPUs" in cap.out and "model transformer-1d, sharding zero1" in cap.out
    rows = [line.split()[0] for line in cap.out.splitlines()[4:10]]
    assert rows == ["bucket", "packed", "static", "dcp-inter", "dcp-intra", "dcp"]
    # bucket needs more optimizer steps than the run has global batches, and the output says why
    assert "bucket:" in cap.out and "no gradient accumulation" in cap.out
    progress = [line for line in cap.err.splitlines() if line.startswith("simulate: ")]
    # one line per finished policy, plus the opening line and (when planning is slow, so on a loaded
    # machine) at most one "planned k/n" line per global batch: never a line per step or per sample
    finished = [line for line in progress if "simulated in" in line]
    assert len(finished) == 6 and "[6/6] dcp" in finished[-1] and progress[0].startswith("simulate: 6 policies")
    assert len(progress) <= 1 + 6 + 6 * 4
    # given explicitly, no defaults line; --quiet: no progress
    assert cli.main(["simulate", "--world-size", "8", "--dataset", "short", "--num-steps", "1", "--policies", "dcp",
                     "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "using defaults" not in cap.out and cap.err == ""


def test_simulate_wan_model_with_sharding(capsys):
    code = cli.main(["simulate", "--model", "wan-1.3b", "--dataset", "wan", "--world-size", "8", "--num-steps", "1",
                     "--policies", "bucket,dcp", "--sharding", "fsdp", "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "model wan-1.3b, sharding fsdp" in out and "dcp" in out


def test_simulate_errors(tmp_path, capsys):
    js = tmp_path / "r.json"
    assert cli.main(["simulate", "--world-size", "4", "--dataset", "nope", "--json", str(js)]) == 2
    assert "unknown distribution" in capsys.readouterr().err and not js.exists()
    assert cli.main(["simulate", "--world-size", "4", "--dataset", "short", "--policies", "x", "--json", str(js)]) == 2
    assert not js.exists()


def test_profile_from_another_model_or_a_smaller_world_is_refused(tmp_path, capsys):
    """A profile holds one model on one world: a larger --world-size or another --model fails with
    exit 2 naming both values; --force turns it into a warning."""
    from test_cost_model import make_profile

    profile = make_profile()
    profile["key"]["world_size"] = 2
    profile["model"].update(num_layers=2, num_heads=4, hidden_size=64)
    prof = write(tmp_path, profile, "profile.json")
    lengths = write(tmp_path, [512, 1024, 2048] * 4)
    code, out = run_plan(tmp_path, lengths, "--world-size", "8", "--profile", str(prof))
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "measured on 2 rank(s)" in err and "--world-size is 8" in err and "--force" in err
    code, out = run_plan(tmp_path, lengths, "--world-size", "2", "--profile", str(prof), "--model", "transformer-1d")
    err = capsys.readouterr().err
    assert code == 2 and "num_layers 2 (profile) vs" in err and "--model transformer-1d" in err
    code, out = run_plan(tmp_path, lengths, "--world-size", "8", "--profile", str(prof), "--force", "--no-drop-last")
    assert code == 0 and out.exists() and "warning: profile" in capsys.readouterr().err
    code, _ = run_plan(tmp_path, lengths, "--world-size", "2", "--profile", str(prof), "--no-drop-last")
    assert code == 0
