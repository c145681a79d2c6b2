"""Peer fidelity: our ``verl`` and ``megatron-hcp`` beside the peers' own published code, same cost model, same tuning.

For each cell (world size x dataset x global-batch multiple, the runs of ``benchmarks/versus_field.py``: the
transformer-1d H100 analytic cost model, the same samples and global batches) each peer is planned twice:

- **ours**: :mod:`lightning_dcp.planning.peers.verl` / :mod:`~lightning_dcp.planning.peers.megatron`;
- **theirs**: the same policy with the part the peer's code covers swapped for that code, imported from the
  installed packages: verl 0.9.1's ``verl/utils/seqlen_balancing.py`` (``calculate_workload``,
  ``get_seqlen_balanced_partitions`` for the data-parallel split -- the few lines of
  ``RayPPOTrainer._balance_batch`` around it are repeated here, the trainer itself needs Ray -- and
  ``rearrange_micro_batches`` for each replica's micro-batches, the replicas run as threads so its
  all-reduces of the micro-batch count and of "within limit" run as in verl); Megatron-Core 0.19.2's
  ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py`` (``BalancedCPScheduler.get_groups_and_subsamples``,
  its rounds and sets as they come out).

Everything else -- the settings tried (the tuning of :mod:`lightning_dcp.planning.peers.base`), the run-wide
recompute, the memory checks, the pricing (:func:`~lightning_dcp.planning.simulator.simulate`) -- is shared,
so the ratio ours / theirs of tokens/s measures how faithfully ours reimplements their code. A cell where
the peer's rules fail (verl: a batch whose sample count its replica count does not divide) must fail on both
sides. ``--grid-check`` also re-tunes ours with every grid step halved and reports how much tokens/s moves.

Install the peers' code once, outside the repository (only this script uses it; nothing of it is vendored)::

    pip install --no-deps --ignore-requires-python --target ~/.cache/lightning-dcp/peer-code \\
        verl==0.9.1 megatron-core==0.19.2

Only the two files above are imported; what they import that is heavy (verl's ``DataProto``, its device
helpers, Megatron's ``parallel_state``) is stubbed. torch (CPU) comes from the project's environment. Run::

    python benchmarks/peer_fidelity.py                       # 32 and 256 GPUs, video/code/long/short, 1x and 4x
    python benchmarks/peer_fidelity.py --worlds 32 --dists code --multiples 1 --grid-check

Writes ``benchmarks/results/peer_fidelity.md``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import platform
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.versus_field import cell_run  # noqa: E402
from lightning_dcp.planning.batches import cut_batches  # noqa: E402
from lightning_dcp.planning.errors import PlanningError  # noqa: E402
from lightning_dcp.planning.peers.megatron import MegatronHCPPolicy, Round  # noqa: E402
from lightning_dcp.planning.peers.verl import VerlPolicy  # noqa: E402
from lightning_dcp.planning.plan import Plan  # noqa: E402
from lightning_dcp.planning.planner import Planner  # noqa: E402
from lightning_dcp.planning.simulator import simulate  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CODE = Path(os.environ.get("LIGHTNING_DCP_PEER_CODE", Path.home() / ".cache" / "lightning-dcp" / "peer-code"))
TARGET = 0.02
"""Ours must be within 2% of theirs in every cell."""


# ------------------------------------------------------------------ their code, imported

def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"{path} not found: install the peers' code first (see this script's docstring)")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def load_verl(root: Path) -> types.ModuleType:
    """verl 0.9.1's ``verl/utils/seqlen_balancing.py`` with ``DataProto``, ``tensordict_utils`` and the device helper stubbed."""
    tu = types.SimpleNamespace(index_select_tensor_dict=lambda batch, idx: idx)
    _stub("verl")
    _stub("verl.protocol", DataProto=object)
    _stub("verl.utils", tensordict_utils=tu)
    _stub("verl.utils.tensordict_utils", index_select_tensor_dict=tu.index_select_tensor_dict)
    _stub("verl.utils.device", get_device_name=lambda: "cpu")
    sb = _load("peer_verl_seqlen_balancing", root / "verl" / "utils" / "seqlen_balancing.py")
    sb.karmarkar_karp = _remembered(sb.karmarkar_karp)  # their functions call it through the module: the same parts
    return sb


def _remembered(kk: Callable[..., list[list[int]]]) -> Callable[..., list[list[int]]]:
    """verl's ``karmarkar_karp`` (a pure function of its arguments) with its answers remembered as
    :func:`lightning_dcp.planning.peers.verl.karmarkar_karp` remembers ours, each call given a fresh copy: tuning asks
    for one partition at every ``max_token_len`` that gives a replica the same micro-batch count."""

    @functools.lru_cache(maxsize=8192)
    def parts(seqlen: tuple, k_partitions: int, equal_size: bool) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p) for p in kk(seqlen_list=list(seqlen), k_partitions=k_partitions, equal_size=equal_size))

    def call(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
        return [list(p) for p in parts(tuple(seqlen_list), k_partitions, equal_size)]

    return call


def load_megatron(root: Path) -> types.ModuleType:
    """Megatron-Core 0.19.2's ``hybrid_cp_schedule.py`` with ``parallel_state`` and ``RerunDataIterator`` stubbed."""
    state = _stub("megatron.core.parallel_state")
    _stub("megatron")
    _stub("megatron.core", parallel_state=state)
    _stub("megatron.core.rerun_state_machine", RerunDataIterator=object)
    _stub("megatron.core.pipeline_parallel")
    return _load("megatron.core.pipeline_parallel.hybrid_cp_schedule",
                 root / "megatron" / "core" / "pipeline_parallel" / "hybrid_cp_schedule.py")


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


class _ThreadDist:
    """``torch.distributed`` for verl's ``rearrange_micro_batches`` run by one thread per data-parallel replica:
    ``all_reduce`` reduces over the threads (MAX / MIN), as the replicas' all-reduce does."""

    class ReduceOp:
        MAX = "max"
        MIN = "min"

    def __init__(self, count: int):
        self.barrier = threading.Barrier(count, timeout=600)
        self.lock = threading.Lock()
        self.slots: list[Any] = []

    def is_initialized(self) -> bool:
        return True

    def all_reduce(self, tensor: Any, op: str = "max", group: Any = None) -> None:
        with self.lock:
            self.slots.append(tensor.clone())
        self.barrier.wait()
        import torch

        stacked = torch.stack(self.slots)
        out = stacked.max(0).values if op == self.ReduceOp.MAX else stacked.min(0).values
        self.barrier.wait()
        with self.lock:
            self.slots.clear()
        self.barrier.wait()
        tensor.copy_(out)


class _Nested:
    """A replica's packed ``input_ids`` as verl's nested tensor shows them: ``offsets().diff()`` are the lengths."""

    is_nested = True

    def __init__(self, lengths: Sequence[int]):
        import torch

        self._offsets = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int64)

    def offsets(self) -> Any:
        return self._offsets


def _cumsum(xs: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += int(x)
        out.append(acc)
    return out


def _their(fn: Callable[[], Any]) -> Any:
    """Their code's failures (asserts, ValueError) as the PlanningError our tuning and tables expect."""
    try:
        return fn()
    except (AssertionError, ValueError) as err:
        raise PlanningError(f"their code: {type(err).__name__}: {err}") from None


def their_verl(sb: types.ModuleType) -> type:
    class TheirVerl(VerlPolicy):
        """:class:`VerlPolicy` with verl's own balancing and micro-batching."""

        def split(self, lengths: Sequence[int], dp: int) -> list[list[int]]:
            import torch

            work_lst = sb.calculate_workload(torch.tensor(list(lengths), dtype=torch.int64)).tolist()
            parts = _their(lambda: sb.get_seqlen_balanced_partitions(work_lst, k_partitions=dp, equal_size=True))
            out = []
            for partition in parts:  # RayPPOTrainer._balance_batch, verl 0.9.1 ray_trainer.py lines 1239-1242
                partition.sort(key=lambda x: (work_lst[x], x))
                out.append(partition[::2] + partition[1::2][::-1])
            return out

        def micro_batches(self, replicas: list[list[int]], lengths: list[int], work: list[int],
                          max_token_len: int) -> list[list[list[int]]]:
            fake = _ThreadDist(len(replicas))
            sb.dist = fake
            results: list[Any] = [None] * len(replicas)

            def one(j: int) -> None:
                batch = {"input_ids": _Nested([lengths[i] for i in replicas[j]])}
                try:
                    _, idx = sb.rearrange_micro_batches(batch, max_token_len, dp_group=object(), same_micro_num_in_dp=True)
                    results[j] = [[replicas[j][i] for i in p] for p in idx]
                except (AssertionError, ValueError) as err:
                    results[j] = err
                    fake.barrier.abort()
                except threading.BrokenBarrierError:
                    results[j] = None

            threads = [threading.Thread(target=one, args=(j,)) for j in range(len(replicas))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            errs = [r for r in results if isinstance(r, BaseException)]
            if errs or any(r is None for r in results):
                raise PlanningError(f"their code: {type(errs[0]).__name__ if errs else 'aborted'}: {errs[0] if errs else ''}")
            return results

    return TheirVerl


def their_megatron(hcp: types.ModuleType) -> type:
    class TheirMegatron(MegatronHCPPolicy):
        """:class:`MegatronHCPPolicy` with Megatron-Core's own ``BalancedCPScheduler``."""

        def rounds(self, lengths: Sequence[int], per_rank: int) -> list[Round]:
            sched = hcp.BalancedCPScheduler(per_rank, _Group(self.world_size))
            groups, ids = _their(lambda: sched.get_groups_and_subsamples([(i, int(n)) for i, n in enumerate(lengths)], None))
            out = []
            for per_gpu in ids:  # one round: each GPU's sample ids; a set = the GPUs with the same list
                rnd = Round(self.world_size)
                seen: dict[tuple[int, ...], int] = {}
                for gpu_ids in per_gpu:
                    key = tuple(gpu_ids)
                    if key in seen:
                        rnd.sizes[seen[key]] += 1
                        continue
                    seen[key] = len(rnd.sizes)
                    rnd.sizes.append(1)
                    rnd.samples.append([(i, int(lengths[i])) for i in key])
                    rnd.loads.append(0.0)
                out.append(rnd)
            return out

    return TheirMegatron


# ------------------------------------------------------------------ one cell

def measure(world: int, cm: Any, dataset: list[int], batches: list[list[int]], policy: str, cls: type | None,
            **opts: Any) -> dict:
    """tokens/s of ``policy`` (its class swapped for ``cls`` when given) on ``batches``, tuned on them."""
    planner = Planner(world, cm, policy, dataset_lengths=dataset, **opts)
    if cls is not None:
        planner.policy = cls(world, planner.view, seed=0, dataset_lengths=planner.dataset_lengths, **opts)
    t0 = time.perf_counter()
    steps, start = [], 0
    try:
        planner.prepare(batches)
        for k, b in enumerate(batches):
            steps.extend(planner.plan_batch(range(start, start + len(b)), b, step=k).steps)
            start += len(b)
    except PlanningError as err:
        return {"tokens_per_s": None, "error": str(err), "setting": None, "seconds": time.perf_counter() - t0}
    sim = simulate(Plan(policy, world, tuple(steps), {"seed": 0}), cm, timeline=False)
    return {"tokens_per_s": sim.tokens_per_s, "error": "", "setting": planner.policy.setting,
            "tried": len(planner.policy.trials), "seconds": time.perf_counter() - t0}


def trimmed(batches: list[list[int]], world: int) -> list[list[int]]:
    """Each batch cut to a multiple of ``world`` samples (its first ones): what a verl run's batches are, verl checking
    ``train_batch_size * rollout.n % n_gpus == 0`` (``verl/utils/config.py``), so every replica count divides them."""
    return [b[: len(b) // world * world] for b in batches if len(b) >= world]


def sampled(world: int, cm: Any, dataset: list[int], batches: list[list[int]], peer: str, theirs: type,
            count: int) -> dict:
    """Theirs at ``count`` of the settings our tuning tried (its four fastest, the rest spread over the trials):
    tokens/s of the fastest of them, and at how many the two plans are the same, item for item."""
    ours = Planner(world, cm, peer, dataset_lengths=dataset).policy
    try:
        ours.prepare(batches)
    except PlanningError:  # no setting of ours runs: theirs must fail too, by its own tuning (it fails fast then)
        return measure(world, cm, dataset, batches, peer, theirs)
    ranked = sorted((t for t in ours.trials if t.seconds_per_token < float("inf")), key=lambda t: t.seconds_per_token)
    rest = ranked[4:]
    pick = [t.setting for t in ranked[:4]] + [t.setting for t in rest[:: max(1, len(rest) // max(1, count - 4))]]
    pick = list(dict.fromkeys(pick))[:count]
    them = theirs(world, ours.view, seed=0, dataset_lengths=ours.dataset_lengths)
    them.axes(batches)  # its run-wide state (the run's lengths), as tuning sets it
    best, best_setting, same = None, None, 0
    for setting in pick:
        try:
            mine = [st for b in batches for st in ours.plan_with(setting, range(len(b)), b)]
            other = [st for b in batches for st in them.plan_with(setting, range(len(b)), b)]
        except PlanningError:
            continue
        same += [s.items for s in mine] == [s.items for s in other]
        tps = simulate(Plan(peer, world, tuple(other), {}), cm, timeline=False).tokens_per_s
        if best is None or tps > best:
            best, best_setting = tps, setting
    return {"tokens_per_s": best, "error": "" if best else "no sampled setting ran", "setting": best_setting,
            "same": same, "compared": len(pick)}


def run_cell(world: int, dist: str, multiple: float, impls: dict, grid_check: bool, steps: int,
             sample_from: int, count: int) -> list[dict]:
    cm, dataset, run, gbt = cell_run(world, dist, steps, "transformer-1d", multiple=multiple)
    rows = []
    for peer, theirs in impls.items():
        variants = [("token-cut", [[run[i] for i in b] for b in cut_batches(run, global_batch_tokens=gbt)])]
        if peer == "verl":
            variants.append((f"x{world} samples", trimmed(variants[0][1], world)))
        for label, batches in variants:
            ours = measure(world, cm, dataset, batches, peer, None)
            if world >= sample_from:
                their = sampled(world, cm, dataset, batches, peer, theirs, count)
            else:
                their = measure(world, cm, dataset, batches, peer, theirs)
            row = {"gpus": world, "dataset": dist, "multiple": multiple, "batch_tokens": gbt, "peer": peer,
                   "batches": label, "ours": ours, "theirs": their}
            if grid_check and ours["tokens_per_s"]:
                row["fine"] = measure(world, cm, dataset, batches, peer, None, grid_scale=2.0)
            rows.append(row)
            print(f"{world:4d} {dist:6s} {multiple:g}x {peer:13s} {label:12s} " + verdict(row), flush=True)
    return rows


def verdict(row: dict) -> str:
    o, t = row["ours"], row["theirs"]
    if o["tokens_per_s"] and t["tokens_per_s"]:
        ratio = o["tokens_per_s"] / t["tokens_per_s"]
        s = f"{ratio:.4f} ({o['tokens_per_s']:,.0f} / {t['tokens_per_s']:,.0f} tokens/s)"
        if "compared" in t:
            s += f"; plans identical at {t['same']}/{t['compared']} sampled settings"
        if "fine" in row and row["fine"]["tokens_per_s"]:
            s += f"; grid halved: {100 * (row['fine']['tokens_per_s'] / o['tokens_per_s'] - 1):+.2f}%"
        return s
    if not o["tokens_per_s"] and not t["tokens_per_s"]:
        return "both fail: " + _short(o["error"])
    return f"MISMATCH: ours {o['tokens_per_s'] or _short(o['error'])}, theirs {t['tokens_per_s'] or _short(t['error'])}"


def _short(err: str) -> str:
    head = err.split("; ", 2)
    return "; ".join(head[:2])[:220]


def markdown(rows: Sequence[dict], command: str, elapsed: float) -> str:
    lines = ["# Peer fidelity: ours vs the peers' own code", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- machine: {platform.platform()}, {os.cpu_count()} CPUs shared ({elapsed:.0f} s)",
             f"- command: `{command}`",
             "- theirs: verl 0.9.1 `verl/utils/seqlen_balancing.py` (`get_seqlen_balanced_partitions`, "
             "`rearrange_micro_batches`), Megatron-Core 0.19.2 `megatron/core/pipeline_parallel/hybrid_cp_schedule.py` "
             "(`BalancedCPScheduler`), imported from the installed packages (`benchmarks/peer_fidelity.py`'s docstring)",
             "- same cost model (transformer-1d, H100 analytic), same runs and global batches as `benchmarks/versus_field.py`, "
             "same tuning (`lightning_dcp.planning.peers.base`); tokens/s from the simulator",
             f"- target: ours / theirs within {100 * TARGET:.0f}% in every cell; a cell where the peer's rules fail must "
             "fail on both sides", "- cells of 256 GPUs and more (`--sample-from`): their code is slow there (Megatron's scheduler "
             "scans every rank per sample), so theirs runs at `--sample` of the settings our tuning tried (its four "
             "fastest and the rest spread over the grid), the plans compared item for item; theirs = the fastest of those",
             "- batches: `token-cut` are versus_field's (closed at the batch tokens); for verl also "
             "`xW samples`, each batch cut to a multiple of the GPUs (what verl's own batch-size check makes a verl run's "
             "batches), so its equal-count split runs", ""]
    has_fine = any("fine" in r for r in rows)
    lines += ["| GPUs | dataset | batch | batch tokens | peer | batches | ours / theirs | ours tokens/s | theirs tokens/s | setting (ours) |"
              + (" grid halved |" if has_fine else ""),
              "|---:|---|---:|---:|---|---|---:|---:|---:|---|" + ("---:|" if has_fine else "")]
    worst = 0.0
    for r in rows:
        o, t = r["ours"], r["theirs"]
        if o["tokens_per_s"] and t["tokens_per_s"]:
            ratio = o["tokens_per_s"] / t["tokens_per_s"]
            worst = max(worst, abs(ratio - 1))
            tag = f" (sampled: plans identical at {t['same']}/{t['compared']})" if "compared" in t else ""
            cells = [f"{ratio:.4f}{tag}", f"{o['tokens_per_s']:,.0f}", f"{t['tokens_per_s']:,.0f}", _setting(o["setting"])]
        elif not o["tokens_per_s"] and not t["tokens_per_s"]:
            cells = ["both fail", "-", "-", _short(o["error"]).replace("|", "/")]
        else:
            worst = max(worst, 1.0)
            cells = ["MISMATCH", str(o["tokens_per_s"] or "fails"), str(t["tokens_per_s"] or "fails"),
                     _short(o["error"] or t["error"]).replace("|", "/")]
        fine = ""
        if has_fine:
            f = r.get("fine")
            fine = f" {100 * (f['tokens_per_s'] / o['tokens_per_s'] - 1):+.2f}% |" if f and f["tokens_per_s"] else " - |"
        lines.append(f"| {r['gpus']} | {r['dataset']} | {r['multiple']:g}x | {r['batch_tokens']:,} | {r['peer']} | "
                     f"{r['batches']} | "
                     + " | ".join(cells) + " |" + fine)
    lines += ["", f"Largest deviation from 1 over the cells both run: {100 * worst:.2f}%.", ""]
    return "\n".join(lines) + "\n"


def _setting(s: Any) -> str:
    if s is None:
        return "-"
    return ", ".join(f"{k}={v}" for k, v in s._asdict().items()) if hasattr(s, "_asdict") else str(s)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-code", type=Path, default=DEFAULT_CODE, help="where the peers' packages are installed")
    ap.add_argument("--worlds", default="32,256")
    ap.add_argument("--dists", default="video,code,long,short")
    ap.add_argument("--multiples", default="1,4", help="global batch multiples of the default size")
    ap.add_argument("--peers", default="verl,megatron-hcp")
    ap.add_argument("--steps", type=int, default=2, help="global batches per cell below 256 GPUs (1 at 256 and more)")
    ap.add_argument("--grid-check", action="store_true", help="also re-tune ours with every grid step halved")
    ap.add_argument("--sample-from", type=int, default=256,
                    help="from this world size on, run theirs at --sample settings of our tuning, not its own tuning")
    ap.add_argument("--sample", type=int, default=16, help="settings theirs runs at in a sampled cell")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "peer_fidelity.md")
    args = ap.parse_args(argv)
    theirs = {"verl": lambda: their_verl(load_verl(args.peer_code)),
              "megatron-hcp": lambda: their_megatron(load_megatron(args.peer_code))}
    impls = {p: theirs[p]() for p in args.peers.split(",")}
    t0 = time.perf_counter()
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        for dist in args.dists.split(","):
            for m in (float(x) for x in args.multiples.split(",")):
                rows += run_cell(world, dist, m, impls, args.grid_check, args.steps if world < 256 else 1,
                                 args.sample_from, args.sample)
    command = "python benchmarks/peer_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows, command.strip(), time.perf_counter() - t0))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
