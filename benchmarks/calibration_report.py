"""Predicted vs measured step time from a ``benchmarks/run.py`` run's records (calibration on).

Reads the per-step ``metrics.calibration`` rows (rank 0's records) of the measured epochs and prints,
per policy: the mean |predicted - measured| / measured of the slowest rank's item time under the
factors each step was planned with, the same for the uncalibrated cost model, the refits and the
last rank speeds::

    python benchmarks/calibration_report.py benchmarks/results/calib/records
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def report(records_dir: Path, warmup_epochs: int = 1) -> list[str]:
    lines = []
    for policy_dir in sorted(p for p in records_dir.iterdir() if p.is_dir()):
        rank0 = policy_dir / "rank0.json"
        if not rank0.exists():
            continue
        recs = [r for r in json.loads(rank0.read_text())["records"] if r["epoch"] >= warmup_epochs]
        cal = [r["metrics"]["calibration"] for r in recs if (r.get("metrics") or {}).get("calibration")]
        if not cal:
            lines.append(f"{policy_dir.name}: no calibration rows (calibration='off'?)")
            continue
        err = sum(abs(c["measured_s"] - c["predicted_s"]) / c["measured_s"] for c in cal) / len(cal)
        base = sum(abs(c["measured_s"] - c["base_predicted_s"]) / c["measured_s"] for c in cal) / len(cal)
        speeds = ", ".join(f"{s:.2f}" for s in cal[-1]["rank_speeds"]) or "all 1.00"
        lines.append(f"{policy_dir.name}: {len(cal)} steps, predicted vs measured off by {100 * err:.1f}% "
                     f"(uncalibrated {100 * base:.1f}%), {cal[-1]['refits']} refits, rank speeds [{speeds}]")
    return lines


if __name__ == "__main__":
    args = sys.argv[1:]
    print("\n".join(report(Path(args[0]), int(args[1]) if len(args) > 1 else 1)))
