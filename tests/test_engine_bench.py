"""benchmarks/bench_serving.py --smoke on the CPU: the H200 script runs end to end (its GPU
session is a single call, so a crash there would cost the whole measurement). ~25 s, so slow:
run it with `pytest -m slow tests/test_engine_bench.py` after touching the engine or the script."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_serving_smoke_runs_every_phase(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_serving.py"), "--smoke", f"--output_dir={tmp_path}",
         "--steps=3", "--warm_steps=1", "--concurrency=1,16", "--time_budget_s=1000",
         '--hisparse_decode_xla_options={"xla_gpu_enable_command_buffer": ""}', "--cuda_graph_max_bs=1", "--decode_program_copies=2"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "bench_serving.json") as f:
        results = json.load(f)
    assert results["errors"] == [], results["errors"]
    capacity = results["setup"]["capacity"]
    assert capacity["hisparse"] > capacity["baseline"] >= 1
    assert results["setup"]["decode_xla_options"] == {}
    assert results["setup"]["hisparse_decode_xla_options"] == {"xla_gpu_enable_command_buffer": ""}
    assert results["setup"]["cuda_graph_max_bs"] == 1 and results["setup"]["decode_program_copies"] == 2
    phases = {(p["phase"], p["mode"]) for p in results["points"]}
    assert phases == {("model", "hisparse"), ("model", "baseline"), ("synthetic", "hisparse"),
                      ("synthetic", "baseline"), ("equal_slots", "hisparse")}  # fmt: skip
    for p in results["points"]:
        assert p["running"] == min(p["max_concurrency"], p["slots"]) and p["timed_steps"] == 3
        assert p["decode_throughput"] > 0 and (p["miss_rate"] > 0) == (p["mode"] == "hisparse")
        if p["phase"] == "synthetic":
            assert p["selection"].startswith("SYNTHETIC") and p["measured_topk_overlap"] is not None
    assert {r["phase"] for r in results["ratios"]} == {"model", "synthetic", "equal_slots"}
    fits = {(f["phase"], f["mode"]) for f in results["step_cost_fit"]}
    assert ("model", "hisparse") in fits and ("model", "baseline") in fits
    assert [a["prefill_token_budget"] for a in results["arrivals"]] == [None, 48]
    assert all(a["itl_ms"]["p99"] > 0 for a in results["arrivals"])
    for name in ("throughput_model_selection", "misses_model_selection", "throughput_synthetic_selection"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_serving_merges_a_run_of_the_other_engine(tmp_path):
    """A rank's two engines run in two device calls (--modes, --merge_from): the second run
    takes the first's points when both measured the same setup, including a first run written
    before --fp8_activations, fp8 indexer queries and miss_read existed (no such keys: it ran without them). miss_read
    does not touch the baseline, so a baseline run merges whatever its value; HiSparse points
    measured with another miss_read are refused."""

    def run(mode, out, *extra, ok=True):
        done = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "bench_serving.py"), "--smoke", f"--output_dir={out}", "--steps=2",
             "--warm_steps=1", "--concurrency=1", "--phases=synthetic", "--profile_steps=0", f"--modes={mode}", *extra],
            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900,
        )  # fmt: skip
        if not ok:
            return done
        assert done.returncode == 0, done.stderr[-3000:]
        with open(out / "bench_serving.json") as f:
            return json.load(f)

    first = run("baseline", tmp_path / "a")
    for key in ("fp8_activations", "indexer_queries", "value_lift"):
        del first["setup"]["model"][key]
    del first["setup"]["hisparse_config"]["miss_read"]
    with open(tmp_path / "old.json", "w") as f:
        json.dump(first, f)
    attention = '--hisparse_config={"miss_read": "attention"}'
    merged = run("hisparse", tmp_path / "b", attention, f"--merge_from={tmp_path / 'old.json'}")
    assert {p["mode"] for p in merged["points"]} == {"hisparse", "baseline"}
    assert merged["merged_from"]["modes"] == ["baseline"]
    assert merged["setup"]["hisparse_config"]["miss_read"] == "attention"
    # Each engine's capacity point was reached under its own concurrency cap (12 and 6 slots):
    # the summary's ratio at capacity still pairs them.
    capacity = merged["setup"]["capacity"]
    at_capacity = {p["mode"]: p["decode_throughput"] for p in merged["points"] if p["running"] == capacity[p["mode"]]}
    assert capacity["hisparse"] != capacity["baseline"] and set(at_capacity) == {"hisparse", "baseline"}
    assert merged["summary"][0]["ratio_at_capacity"] == at_capacity["hisparse"] / at_capacity["baseline"]
    # HiSparse points read with "attention" do not merge into a run set up with "copy".
    merged["points"] = [p for p in merged["points"] if p["mode"] == "hisparse"]
    with open(tmp_path / "hisparse_attention.json", "w") as f:
        json.dump(merged, f)
    refused = run("baseline", tmp_path / "c", f"--merge_from={tmp_path / 'hisparse_attention.json'}", ok=False)
    assert refused.returncode != 0 and "its setup's hisparse_config differs" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_bench_serving_splits_the_step_at_c1_and_at_capacity(tmp_path):
    """--profile_running=1 adds a step split at one request beside the one at capacity, in the
    same engine (its slots: capacity), and the per-token comparison keeps the capacity splits."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_serving.py"), "--smoke", f"--output_dir={tmp_path}", "--steps=2",
         "--warm_steps=1", "--concurrency=1,64", "--phases=synthetic", "--profile_steps=1", "--profile_running=1"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "bench_serving.json") as f:
        results = json.load(f)
    capacity = results["setup"]["capacity"]
    splits = {(e["mode"], e["running"]): e for e in results["step_split"]}
    assert set(splits) == {("hisparse", 1), ("hisparse", capacity["hisparse"]), ("baseline", 1), ("baseline", capacity["baseline"])}
    assert all(e.get("categories_ms") and e["steps"] >= 1 for e in splits.values()), splits
    assert splits["hisparse", 1]["trace_dir"].endswith("trace_hisparse_running1")
    host = splits["hisparse", 1]["host_events"]  # where a host-bound step's time goes
    assert host and all(e["ms_per_step"] > 0 and e["threads"] for e in host), host
    assert "--xla_enable_command_buffers_during_profiling=true" in results["xla_flags"]
    for row in results["step_split_per_token"]:
        assert row["hisparse_ms_per_step"] == splits["hisparse", capacity["hisparse"]]["categories_ms"][row["category"]]
        assert row["baseline_ms_per_step"] == splits["baseline", capacity["baseline"]]["categories_ms"][row["category"]]
    assert (tmp_path / "step_split.png").stat().st_size > 0
    copies = (tmp_path / "state_copies.txt").read_text()  # from the dump the split read, before it is removed
    assert "greedy_decode_step" in copies and "aliased to outputs" in copies, copies
    assert not (tmp_path / "hlo_dump").exists()


def test_capacity_ratio_pairs_each_engines_capacity_point_whatever_cap_reached_it():
    from benchmarks.helpers import capacity_ratio

    point = lambda mode, cap, running, tps, phase="synthetic": dict(mode=mode, max_concurrency=cap, running=running, decode_throughput=tps, phase=phase)  # noqa: E731
    points = [point("hisparse", 1, 1, 30.0), point("hisparse", 64, 37, 440.0), point("baseline", 1, 1, 37.0),
              point("baseline", 8, 8, 176.0), point("baseline", 64, 37, 999.0, phase="model")]  # fmt: skip
    assert capacity_ratio(points, {"hisparse": 37, "baseline": 8}) == 440.0 / 176.0
    assert capacity_ratio(points, {"hisparse": 37, "baseline": 9}) is None  # the baseline never reached 9


def test_rank_summary_names_what_holds_each_missed_goal(tmp_path, capsys):
    """benchmarks/rank_summary.py over two committed H200 rank runs: GLM-5.1 at 61,440 meets both
    goals; DeepSeek-V3.2 at 61,440 misses both, and the summary gives the step its capacity needs
    (37 x the baseline's 45.17 ms / (3 x 8) = 69.6 ms) and the measured split it is held by."""
    from benchmarks.rank_summary import main, summarize

    perf = os.path.join(ROOT, "docs", "perf")
    paths = [os.path.join(perf, name) for name in (
        "bench_serving_rank_deepseek_61440_h200_2026-12-04_s12.json", "bench_serving_rank_glm_61440_h200_2026-12-04_s13.json")]  # fmt: skip
    deepseek, glm = summarize(paths)[0]
    assert (glm["preset"], glm["meets_capacity_goal"], glm["meets_c1_goal"], glm["held_by"], glm["c1_held_by"]) == (
        "glm-5.1-fp8-dp8-rank", True, True, None, None)  # fmt: skip
    assert not deepseek["meets_capacity_goal"] and not deepseek["meets_c1_goal"]
    held = deepseek["held_by"]
    assert abs(held["needed_itl_ms"] - 69.6) < 0.1 and held["hisparse_itl_ms"] > held["needed_itl_ms"]
    assert set(held["over_baseline_ms"]) == {"attention", "indexer", "moe", "dense_gemm", "swap_in", "other"}
    assert deepseek["c1_held_by"]["host_ms"] > 0
    # Per further request: the categories' slopes add up to the device busy time's, and the goal
    # allows less than HiSparse adds now (the split's own figures, recomputed here).
    slopes = held["hisparse_per_request_ms"]
    assert abs(sum(slopes[c] for c in held["over_baseline_ms"]) - slopes["device_busy"]) < 0.05
    with open(paths[0]) as f:
        one = next(s for s in json.load(f)["step_split"] if s["mode"] == "hisparse" and s["running"] == 1)
    assert abs(held["needed_per_request_ms"] - (held["needed_itl_ms"] - one["device_busy_ms_per_step"]) / 36) < 1e-9
    assert 0 < held["needed_per_request_ms"] < slopes["device_busy"]
    assert main(["rank_summary.py", os.path.join(perf, "no_such_run.json")]) == 2
    plot = tmp_path / "ratios.png"
    assert main(["rank_summary.py", f"--plot={plot}", *paths]) == 0
    printed = capsys.readouterr().out
    assert plot.read_bytes()[:4] == b"\x89PNG" and "| glm-5.1-fp8-dp8-rank | 61,440 |" in printed
    assert "| deepseek-v3.2-dp8-rank | 61,440 | hisparse |" in printed
