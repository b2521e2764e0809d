"""PNG figures of serving runs (matplotlib, Agg backend: no display needed).

Each figure takes plain lists/dicts (what the results JSON holds) and a `label` that goes into
its title: the selection ("model" or "synthetic(overlap=...)") and context kind, so a synthetic
figure can never pass for a real-model one.
"""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from serving.telemetry import written_whole  # noqa: E402


def rolling_mean(values, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return values
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _title(ax, text: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(text, 70)), fontsize=9)


def _save(fig, path) -> None:
    fig.tight_layout()
    with written_whole(path) as tmp:  # whole or not at all, as the results JSON
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def throughput_vs_concurrency(points: list[dict], path, *, label: str, metric: str = "output_throughput", linear: bool = False) -> None:
    """points: {"mode", "max_concurrency", metric} dicts; one line per mode. metric:
    "output_throughput" (tokens over the run's wall time) or "decode_throughput" (over decode steps).
    linear: also each mode's linear scaling, dashed: its lowest point's throughput per running
    request x the requests running at each point (points then need "running")."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({p["mode"] for p in points}):
        mine = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["max_concurrency"])
        concurrency = [p["max_concurrency"] for p in mine]  # i[points]
        (line,) = ax.plot(concurrency, [p[metric] for p in mine], marker="o", label=mode)
        if linear and len(mine) > 1:
            per_request = mine[0][metric] / mine[0]["running"]  # what one request gets at the lowest point
            ax.plot(concurrency, [per_request * p["running"] for p in mine], linestyle="--", color=line.get_color(),
                    label=f"{mode}: linear from c={mine[0]['max_concurrency']}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency (requests in flight)")
    ax.set_ylabel(f"{metric.replace('_', ' ')} (tokens/s)")
    _title(ax, f"Throughput vs concurrency [{label}]")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def misses_over_time(series: dict[str, list[int]], path, *, label: str, window: int = 8) -> None:
    """series: name -> misses per decode step; plotted as a trailing mean over `window` steps."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, misses in series.items():
        ax.plot(rolling_mean(misses, window), label=name)
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"misses per step (rolling mean, {window} steps)")
    _title(ax, f"Host->device misses over time [{label}]")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def misses_vs_buffer_size(points: list[dict], path, *, label: str) -> None:
    """points: {"device_buffer_size", "miss_rate", "misses_per_request_step"} dicts, one per size."""
    points = sorted(points, key=lambda p: p["device_buffer_size"])
    sizes = [p["device_buffer_size"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [p["misses_per_request_step"] for p in points], marker="o", color="tab:red")
    ax.set_xlabel("device_buffer_size (slots per request and layer)")
    ax.set_ylabel("misses per request per step (all layers)", color="tab:red")
    twin = ax.twinx()
    twin.plot(sizes, [p["miss_rate"] for p in points], marker="s", color="tab:blue", label="miss rate")
    twin.set_ylabel("miss rate (misses / selected rows)", color="tab:blue")
    twin.set_ylim(0, 1)
    _title(ax, f"Misses vs device buffer size [{label}]")
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def accepted_per_step(series: dict[str, list[float]], path, *, label: str, window: int = 8) -> None:
    """series: name -> a speculative run's tokens per request in each decode step (accepted drafts
    + 1: the acceptance length of the step), raw and as a trailing mean over `window` steps."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        line = ax.plot(rolling_mean(values, window), label=f"{name} (rolling mean, {window} steps)")[0]
        ax.plot(values, ".", markersize=3, alpha=0.4, color=line.get_color())
    ax.set_xlabel("decode step")
    ax.set_ylabel("accepted tokens per request (drafts + 1)")
    ax.set_ylim(bottom=0)
    _title(ax, f"Speculative decoding: accepted tokens per step [{label}]")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def ratios_against_goals(rows: list[dict], path, *, label: str) -> None:
    """Issue 21's table as bars: per preset (one colour each) and context, ratio_at_capacity
    (left) and ratio_c1 (right), each goal a black tick over its bar. rows: rank_summary's
    [{preset, context, ratio_at_capacity, capacity_goal, ratio_c1, c1_goal}] (None: not measured)."""
    presets = sorted({r["preset"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    width = 0.8 / max(1, len(presets))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, field, goal_field, title in ((axes[0], "ratio_at_capacity", "capacity_goal", "throughput at capacity / baseline's"),
                                         (axes[1], "ratio_c1", "c1_goal", "throughput at c = 1 / baseline's")):  # fmt: skip
        for i, preset in enumerate(presets):
            by_context = {r["context"]: r for r in rows if r["preset"] == preset}
            x = np.arange(len(contexts)) + (i - (len(presets) - 1) / 2) * width
            values = [by_context.get(c, {}).get(field) for c in contexts]
            ax.bar(x, [v or 0.0 for v in values], width, label=preset)
            for xi, c, v in zip(x, contexts, values):
                if c in by_context:
                    goal = by_context[c][goal_field]
                    ax.plot([xi - width / 2, xi + width / 2], [goal, goal], color="black", linewidth=2)
                ax.annotate("not run" if v is None else f"{v:.2f}x", (xi, v or 0.0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(contexts)), [f"{c:,}" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("HiSparse / baseline")
        _title(ax, f"{title}; black: the goal ({label})")
        ax.legend(fontsize=7)
    _save(fig, path)
