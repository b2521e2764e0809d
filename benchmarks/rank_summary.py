"""Issue 21's table from the rank runs' JSONs (bench_serving.py --preset): per preset and context,
capacities, ratio_at_capacity and ratio_c1 against their goals, and for each ratio that misses
its goal the measured step split at capacity of both engines, the step HiSparse would need and
the category that holds it (the largest difference over the baseline, in ms per step); and,
per category, what each further running request adds to each engine's step against what the
goal allows HiSparse (derived from the splits at 1 and at capacity).

    python benchmarks/rank_summary.py --out=docs/perf/bench_serving_rank_h200_<date>.json \
        [--plot=docs/perf/rank_ratios_h200_<date>.png] FILE.json ...

Each FILE is one bench_serving.json holding both engines (a merged run counts as one); where two
files give the same (preset, context), the later on the command line wins. Prints a Markdown
table and writes {"summary": [...], "sources": {...}}: the issue's fields plus the split; --plot
draws both ratios against their goals, per preset and context (serving.plots).
"""

from __future__ import annotations

import json
import os
import sys

# Issue 21: ratio_at_capacity >= 3.0 at 40k and 60k tokens and >= 5.0 at 128k; ratio_c1 >= 0.95.
LONG_CONTEXT = 131072
CAPACITY_GOAL, LONG_CAPACITY_GOAL, C1_GOAL = 3.0, 5.0, 0.95
DEVICE_CATEGORIES = ("attention", "indexer", "moe", "dense_gemm", "swap_in", "other")


def capacity_goal(context: int) -> float:
    return LONG_CAPACITY_GOAL if context >= LONG_CONTEXT else CAPACITY_GOAL


def _point(data: dict, mode: str, running: int) -> dict | None:
    """The synthetic point of `mode` with `running` requests (the first one measured)."""
    return next((p for p in data["points"] if p["mode"] == mode and p["running"] == running and p["phase"] == "synthetic"), None)


def _split(data: dict, mode: str, running: int) -> dict | None:
    """The profiled step split of `mode` at `running`: {category: ms per step, device_busy}."""
    entry = next((s for s in data.get("step_split", []) if s.get("mode") == mode and s.get("running") == running and s.get("categories_ms")), None)
    if entry is None:
        return None
    return dict(entry["categories_ms"], device_busy=entry["device_busy_ms_per_step"])


def per_request(data: dict, mode: str, running: int) -> dict | None:
    """What one more running request adds to `mode`'s profiled step, per device category (ms per
    step): (split at `running` - split at 1) / (running - 1). None below 2 running or without
    both splits. Derived from two measured splits, not measured itself."""
    low, high = _split(data, mode, 1), _split(data, mode, running)
    if running < 2 or low is None or high is None:
        return None
    return {c: (high[c] - low[c]) / (running - 1) for c in (*DEVICE_CATEGORIES, "device_busy")}


def what_holds(data: dict, row: dict) -> dict | None:
    """For a ratio_at_capacity under its goal: the ITL HiSparse's capacity step would need, its
    measured one, and the device categories where it spends more than the baseline's capacity
    step, largest first (ms per step). None when the goal holds or a split is missing."""
    goal = capacity_goal(row["context"])
    if row["ratio_at_capacity"] is None or row["ratio_at_capacity"] >= goal:
        return None
    h_cap, b_cap = row["capacity_hisparse"], row["capacity_baseline"]
    hisparse, baseline = _point(data, "hisparse", h_cap), _point(data, "baseline", b_cap)
    h_split, b_split = _split(data, "hisparse", h_cap), _split(data, "baseline", b_cap)
    if None in (hisparse, baseline, h_split, b_split):
        return None
    # throughput = running / ITL, so goal x the baseline's needs ITL <= h_cap / (goal x its throughput)
    needed_ms = h_cap / (goal * baseline["decode_throughput"]) * 1e3
    over = {c: h_split[c] - b_split[c] for c in DEVICE_CATEGORIES}
    # The per-request budget: from HiSparse's one-request device time, what each further request
    # may add for the needed step, against what it adds now (per_request).
    h_one = _split(data, "hisparse", 1)
    needed_per_request = None if h_one is None or h_cap < 2 else (needed_ms - h_one["device_busy"]) / (h_cap - 1)
    return dict(
        goal=goal, hisparse_itl_ms=hisparse["itl_ms"]["mean"], needed_itl_ms=needed_ms,
        hisparse_device_busy_ms=h_split["device_busy"], baseline_device_busy_ms=b_split["device_busy"],
        over_baseline_ms=dict(sorted(over.items(), key=lambda kv: -kv[1])),
        hisparse_split_ms={c: h_split[c] for c in DEVICE_CATEGORIES}, baseline_split_ms={c: b_split[c] for c in DEVICE_CATEGORIES},
        hisparse_per_request_ms=per_request(data, "hisparse", h_cap), baseline_per_request_ms=per_request(data, "baseline", b_cap),
        needed_per_request_ms=needed_per_request,
    )  # fmt: skip


def what_holds_c1(data: dict, row: dict) -> dict | None:
    """For a ratio_c1 under its goal: HiSparse's c = 1 ITL, the one the goal needs, and its
    device busy time a step where profiled (the rest of the ITL is the host's). None when the
    goal holds or a point is missing."""
    if row["ratio_c1"] is None or row["ratio_c1"] >= C1_GOAL:
        return None
    hisparse, baseline = _point(data, "hisparse", 1), _point(data, "baseline", 1)
    if hisparse is None or baseline is None:
        return None
    split = _split(data, "hisparse", 1)
    busy = None if split is None else split["device_busy"]
    itl = hisparse["itl_ms"]["mean"]
    return dict(hisparse_itl_ms=itl, needed_itl_ms=baseline["itl_ms"]["mean"] / C1_GOAL, hisparse_device_busy_ms=busy,
                host_ms=None if busy is None else itl - busy)  # fmt: skip


def summarize(paths: list[str]) -> tuple[list[dict], dict]:
    rows, sources = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data.get("summary") or []:
            if row.get("ratio_at_capacity") is None and row.get("ratio_c1") is None:
                continue  # one engine only
            key = (row["preset"], row["kv_cache_dtype"], row["context"])
            row = dict(row, source=os.path.basename(path), capacity_goal=capacity_goal(row["context"]), c1_goal=C1_GOAL)
            row["meets_capacity_goal"] = row["ratio_at_capacity"] is not None and row["ratio_at_capacity"] >= row["capacity_goal"]
            row["meets_c1_goal"] = row["ratio_c1"] is not None and row["ratio_c1"] >= C1_GOAL
            row["held_by"] = what_holds(data, row)
            row["c1_held_by"] = what_holds_c1(data, row)
            rows[key] = row
            sources[os.path.basename(path)] = data.get("setup", {}).get("model", {}).get("base")
    return [rows[k] for k in sorted(rows)], sources


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rows: list[dict]) -> str:
    lines = ["| preset | context | capacity H / B | ratio_at_capacity (goal) | what holds it | ratio_c1 (goal 0.95) | what holds it | source |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        held, held_c1 = r["held_by"], r["c1_held_by"]
        holds = holds_c1 = "-"
        if held is not None:
            category, ms = next(iter(held["over_baseline_ms"].items()))
            holds = (f"step {held['hisparse_itl_ms']:.1f} ms, needs <= {held['needed_itl_ms']:.1f}; "
                     f"device busy {held['hisparse_device_busy_ms']:.1f}; most over the baseline: {category} +{ms:.1f} ms")  # fmt: skip
        if held_c1 is not None:
            holds_c1 = f"ITL {held_c1['hisparse_itl_ms']:.1f} ms, needs <= {held_c1['needed_itl_ms']:.1f}"
            if held_c1["host_ms"] is not None:
                holds_c1 += f"; device busy {held_c1['hisparse_device_busy_ms']:.1f}, host {held_c1['host_ms']:.1f}"
        lines.append(
            f"| {r['preset']} | {r['context']:,} | {r['capacity_hisparse']} / {r['capacity_baseline']} | "
            f"{_ratio(r['ratio_at_capacity'])} ({r['capacity_goal']:g}) | {holds} | {_ratio(r['ratio_c1'])} | {holds_c1} | {r['source']} |"
        )
    budget = [r for r in rows if r["held_by"] and r["held_by"]["hisparse_per_request_ms"] and r["held_by"]["needed_per_request_ms"] is not None]
    if budget:  # what each further request adds to the capacity step, and what the goal allows
        lines += ["", "Per further running request, ms per step (derived: (split at capacity - split at 1) / (capacity - 1)):", "",
                  "| preset | context | engine | " + " | ".join(DEVICE_CATEGORIES) + " | device busy | the goal allows |",
                  "|---|---|---|" + "---|" * (len(DEVICE_CATEGORIES) + 2)]  # fmt: skip
        for r in budget:
            held = r["held_by"]
            for engine in ("hisparse", "baseline"):
                slopes = held[f"{engine}_per_request_ms"]
                if slopes is None:
                    continue
                allows = f"{held['needed_per_request_ms']:.3f}" if engine == "hisparse" else ""
                cells = " | ".join(f"{slopes[c]:.3f}" for c in (*DEVICE_CATEGORIES, "device_busy"))
                lines.append(f"| {r['preset']} | {r['context']:,} | {engine} | {cells} | {allows} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--out=")), None)
    plot = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--plot=")), None)
    paths = [a for a in argv[1:] if not a.startswith("--")]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for path in paths:
        if not os.path.isfile(path):
            print(f"error: no such file: {path}", file=sys.stderr)
            return 2
    rows, sources = summarize(paths)
    print(markdown(rows))
    if out:
        with open(out, "w") as f:
            json.dump(dict(summary=rows, sources=sources), f, indent=1)
    if plot:
        from serving.plots import ratios_against_goals  # matplotlib only when asked

        ratios_against_goals(rows, plot, label="H200 EP8 rank, fp8 KV, SYNTHETIC 0.9")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
