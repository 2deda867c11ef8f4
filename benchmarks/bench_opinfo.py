"""Op coverage on torch's OpInfo database: every op's float32 CPU sample through adaptdist, beside DTensor.

For each op of ``op_db`` (see ``tests/opinfo_harness.py`` for what one run does): a batch split over 2 and 3
simulated ranks, and the first input sharded on its last dim; each counted supported / gathers / refused /
xfail (with its reason) / bug, beside DTensor's own coverage of the same sample (fake process group, 2
ranks, batch-sized tensors Shard(0)). Prints the counts per category and writes a per-op JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_opinfo.py --json /tmp/opinfo.json
    ... --ops add,mm,softmax            # only these (OpInfo name or name.variant)
    ... --start 0 --limit 200           # a slice of op_db (run the sweep in pieces; --merge joins the JSONs)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import opinfo_harness as h  # noqa: E402


def sweep(keys: list[str], world_sizes: tuple[int, ...], settings: tuple[str, ...], dtensor: bool,
          progress: bool = True) -> dict:
    ops = h.ops_by_key()
    out = {}
    world = h.dtensor_world() if dtensor else None
    if world is not None:
        world.__enter__()
    try:
        for i, k in enumerate(keys):
            op = ops[k]
            t0 = time.perf_counter()
            sample = h.pick_sample(op)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = h.run_op(op, world_sizes, settings, sample=sample)
                rec = {s: {str(w): o.as_dict() for w, o in d.items()} for s, d in res.items()}
                rec["has_backward"] = bool(op.supports_autograd)
                rec["independent"] = bool(sample is not None and h.independent_samples(op, sample))
                if dtensor:
                    try:
                        rec["dtensor"] = h.dtensor_outcome(op, sample).as_dict()
                    except Exception as e:  # DTensor itself crashed on the sample
                        rec["dtensor"] = h.Outcome("refused", f"{type(e).__name__}: {e}"[:200]).as_dict()
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            out[k] = rec
            if progress:
                cats = " ".join(f"{s}:{'/'.join(rec[s][str(w)]['category'] for w in world_sizes)}" for s in settings)
                print(f"[{i + 1}/{len(keys)}] {k}: {cats}" + (f" dtensor:{rec['dtensor']['category']}" if dtensor else "")
                      + f" ({rec['seconds']:.1f} s)", flush=True)
    finally:
        if world is not None:
            world.__exit__(None, None, None)
    return out


RANK = {"bug": 4, "refused": 3, "gathers": 2, "xfail": 1, "supported": 0}


def worst(rec: dict, setting: str) -> str:
    return max((o["category"] for o in rec[setting].values()), key=RANK.__getitem__)


def report(results: dict) -> str:
    lines = []
    settings = [s for s in h.SETTINGS if any(s in r for r in results.values())]
    cats = h.CATEGORIES
    lines.append(f"{len(results)} OpInfo entries; per op its worst outcome over the world sizes")
    lines.append("setting".ljust(22) + "".join(c.rjust(11) for c in cats))
    for s in settings:
        counts = {c: 0 for c in cats}
        for r in results.values():
            counts[worst(r, s)] += 1
        lines.append(f"adaptdist {s}".ljust(22) + "".join(str(counts[c]).rjust(11) for c in cats))
    if any("dtensor" in r for r in results.values()):
        counts = {c: 0 for c in cats}
        for r in results.values():
            counts[r["dtensor"]["category"]] += 1
        lines.append("DTensor batch (fwd)".ljust(22) + "".join(str(counts[c]).rjust(11) for c in cats))
    if "batch" in settings:
        bw = [k for k, r in results.items() if r["has_backward"] and worst(r, "batch") != "xfail"]
        low = [k for k in bw if worst(results[k], "batch") == "supported"]
        ind = [k for k, r in results.items() if r["independent"] and worst(r, "batch") != "xfail"
               and k not in h.ADDRESSES_ANY_ROW]
        ind_ok = [k for k in ind if worst(results[k], "batch") == "supported"]
        lines.append(f"ops with a backward and a capturable sample: {len(bw)}; lowered under a batch split: "
                     f"{len(low)} ({100 * len(low) / max(1, len(bw)):.1f}%)")
        lines.append(f"ops that keep samples independent (capturable): {len(ind)}; lowered: {len(ind_ok)}"
                     + (f"; not: {', '.join(sorted(set(ind) - set(ind_ok)))}" if len(ind_ok) < len(ind) else ""))
        lines.append("not counted as independent whatever their sample: " + "; ".join(
            f"{k} ({why})" for k, why in sorted(h.ADDRESSES_ANY_ROW.items())))
        if any("dtensor" in r for r in results.values()):
            dt = [k for k in bw if results[k]["dtensor"]["category"] == "supported"]
            lines.append(f"DTensor keeps the batch shard (forward) on {len(dt)} of those {len(bw)} ops "
                         f"({100 * len(dt) / max(1, len(bw)):.1f}%)")
    bugs = [(k, s, w, o["reason"]) for k, r in results.items() for s in settings for w, o in r[s].items()
            if o["category"] == "bug"]
    for k, s, w, why in bugs:
        lines.append(f"BUG {k} [{s}, {w} ranks]: {why}")
    return "\n".join(lines)


def expected_failures(results: dict) -> dict:
    """op -> setting -> {category, reason} for every setting whose worst outcome is gathers/refused/xfail."""
    out: dict = {}
    for k, r in sorted(results.items()):
        for s in h.SETTINGS:
            if s not in r:
                continue
            cat = worst(r, s)
            if cat in ("supported", "bug"):
                continue
            reason = next(o["reason"] for o in r[s].values() if o["category"] == cat)
            if cat == "gathers":
                reason = ("mixes samples on this sample (the op on chunks of the batch differs): " if not r["independent"]
                          else "keeps samples apart, but a rank gathers the batch (no rule keeps the shard): ") + reason
            out.setdefault(k, {})[s] = {"category": cat, "reason": reason}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated OpInfo keys (name or name.variant); default all")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="at most this many ops from --start (0: all)")
    ap.add_argument("--world-sizes", default="2,3")
    ap.add_argument("--settings", default="batch,other")
    ap.add_argument("--no-dtensor", action="store_true")
    ap.add_argument("--json", default="", help="write the per-op results here")
    ap.add_argument("--merge", nargs="*", default=None, help="only join these JSONs (pieces) and report")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--write-expected", default="", help="write the expected-failures list (op -> setting -> "
                    "category and reason) of these results here (tests/opinfo_expected_failures.json)")
    args = ap.parse_args()
    # FakeTensorMode logs every meta kernel that rejects a shape (the sweep's independence check provokes them)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    if args.merge is not None:
        results = {}
        for p in args.merge:
            results.update(json.loads(Path(p).read_text())["ops"])
        print(report(results))
        if args.json:
            Path(args.json).write_text(json.dumps({"ops": results}, indent=1, sort_keys=True))
        if args.write_expected:
            Path(args.write_expected).write_text(json.dumps(expected_failures(results), indent=1, sort_keys=True)
                                                 + "\n")
        return 0
    keys = list(h.ops_by_key())
    if args.ops:
        keys = [k for k in args.ops.split(",") if k]
    else:
        keys = keys[args.start:args.start + args.limit if args.limit else None]
    t0 = time.perf_counter()
    results = sweep(keys, tuple(int(w) for w in args.world_sizes.split(",")), tuple(args.settings.split(",")),
                    not args.no_dtensor, progress=not args.quiet)
    wall = time.perf_counter() - t0
    print(report(results))
    print(f"wall {wall:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"ops": results, "wall_s": wall}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
