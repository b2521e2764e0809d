"""How often does XLA re-record each command buffer (CUDA graph), and why? Reads a log written with
TF_CPP_VMODULE=command_buffer_thunk=3 (command_buffer_h200.sh CB_VLOG=1) and prints, per command
buffer size (num_commands names the buffer well enough: a decode step's buffers differ in size):
how many times it was updated, the host time those updates took, how many allocations had moved
each time (XLA re-records when any allocation its commands use moved), and how many executions
ran between updates (1 = re-recorded on every run).

    python benchmarks/probes/command_buffer_updates.py run.log
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

# jaxlib 0.11.2 spells it "[0] Create/Update command buffer by recoding ..."; XLA's head "Update command buffer on device #0 ...".
UPDATE = re.compile(r"Update command buffer (?:on device #\d+ )?by recoding command buffer cmd sequence after (\d+) "
                    r"executions since last update; num_commands=(\d+); updated_allocs=(\d+)")
UPDATED_IN = re.compile(r"Updated command buffer in (\d+) .s; num_commands=(\d+)")
INITIALIZED_IN = re.compile(r"Initialized command buffer on device #\d+ in (\d+) .s; num_commands=(\d+)")


def summarise(lines) -> dict[int, dict]:
    """num_commands -> {updates, update_us, initialize_us, moved_allocs: Counter, runs_between: Counter}."""
    per_buffer = collections.defaultdict(lambda: {
        "updates": 0, "update_us": 0, "initializations": 0, "initialize_us": 0,
        "moved_allocs": collections.Counter(), "runs_between": collections.Counter()})
    for line in lines:
        if m := UPDATE.search(line):
            runs, commands, moved = map(int, m.groups())
            entry = per_buffer[commands]
            entry["updates"] += 1
            entry["moved_allocs"][moved] += 1
            entry["runs_between"][runs] += 1
        elif m := UPDATED_IN.search(line):
            per_buffer[int(m.group(2))]["update_us"] += int(m.group(1))
        elif m := INITIALIZED_IN.search(line):
            entry = per_buffer[int(m.group(2))]
            entry["initializations"] += 1
            entry["initialize_us"] += int(m.group(1))
    return per_buffer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    args = parser.parse_args(argv[1:])
    with open(args.log, errors="replace") as f:
        per_buffer = summarise(f)
    if not per_buffer:
        print(f"{args.log}: no command_buffer_thunk lines: was TF_CPP_VMODULE=command_buffer_thunk=3 set?", file=sys.stderr)
        return 2
    print(f"{'commands':>9} {'updates':>8} {'update ms':>10} {'ms/update':>10} {'inits':>6}  moved allocs (count)   runs between updates (count)")
    for commands, e in sorted(per_buffer.items(), key=lambda kv: -kv[1]["update_us"]):
        per_update = e["update_us"] / e["updates"] / 1e3 if e["updates"] else 0.0
        moved = ", ".join(f"{k}:{v}" for k, v in sorted(e["moved_allocs"].items()))
        runs = ", ".join(f"{k}:{v}" for k, v in sorted(e["runs_between"].items()))
        print(f"{commands:>9} {e['updates']:>8} {e['update_us'] / 1e3:>10.1f} {per_update:>10.3f} {e['initializations']:>6}  {moved:<22} {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
