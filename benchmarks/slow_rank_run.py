"""One rank slowed down on purpose: dcp with the fit-start profile vs dcp that calibrates, measured.

Runs ``benchmarks/run.py`` twice with the same data, processes and slow rank
(``LIGHTNING_DCP_SLOW_RANK``: that rank sleeps ``FACTOR - 1`` times each micro-batch's own duration
after it), once with ``--calibration off`` (plans from the fit-start profile, speed-blind) and once
with ``--calibration adaptive`` (the run refits time scales, rank speeds and the step overhead and
plans with them), and prints tokens/s, imbalance and the ratio::

    python benchmarks/slow_rank_run.py --slow 1:1.5 -- --model tiny-1d --distribution balanced \\
        --num-samples 192 --global-batch-size 32 --warmup-epochs 2 --epochs 3 --calibrate-every 4

Everything after ``--`` goes to ``run.py`` (its ``--policies`` defaults to ``dcp`` here). The results
land in ``<out>/slow_rank/{off,adaptive}`` and a table in ``<out>/slow_rank/slow_rank.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(mode: str, slow: str, out: Path, rest: list[str]) -> list[dict]:
    """``run.py`` with ``--calibration mode`` and the slow rank; its CSV rows."""
    env = dict(os.environ, LIGHTNING_DCP_SLOW_RANK=slow)
    cmd = [sys.executable, str(HERE / "run.py"), "--calibration", mode, "--out", str(out / mode), "--tag", "run"]
    if "--policies" not in rest:
        cmd += ["--policies", "dcp"]
    subprocess.run(cmd + rest, env=env, check=True)
    with open(out / mode / "run" / "run.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def table(off: list[dict], on: list[dict], slow: str) -> list[str]:
    lines = [f"Rank slowed by LIGHTNING_DCP_SLOW_RANK={slow}; measured epochs only.", "",
             "| policy | tokens/s, fit-start profile | tokens/s, calibrated | calibrated / profile | "
             "imbalance, profile | imbalance, calibrated | rank speeds at the end |", "|---|---:|---:|---:|---:|---:|---|"]
    by = {r["policy"]: r for r in off}
    for r in on:
        b = by.get(r["policy"])
        if b is None:
            continue
        t_off, t_on = float(b["tokens_per_s"]), float(r["tokens_per_s"])
        lines.append(f"| {r['policy']} | {t_off:,.0f} | {t_on:,.0f} | {t_on / t_off:.2f}x | "
                     f"{float(b['imbalance']):.3f} | {float(r['imbalance']):.3f} | {r.get('rank_speeds', '')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slow", default="1:1.5", help="RANK:FACTOR for LIGHTNING_DCP_SLOW_RANK")
    p.add_argument("--out", default=str(HERE / "results"), help="output directory")
    args = p.parse_args(own)
    out = Path(args.out) / "slow_rank"
    off = run_one("off", args.slow, out, rest)
    on = run_one("adaptive", args.slow, out, rest)
    lines = table(off, on, args.slow)
    text = "\n".join(lines + ["", "command: `python benchmarks/slow_rank_run.py " + " ".join(argv) + "`", ""])
    (out / "slow_rank.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
