"""Where does an XLA compile spend its time? Sums XLA's per-pass times from a log written with
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1` (one line per pass run: "HLO pass:
NAME time: N us ...") and prints the passes that took longest, with their run counts and the total.
The HiSparse decode step of a 61-layer rank compiled for more than 6 minutes on the H200 where the
baseline's took about one (docs/PERFORMANCE.md, 2026-12-03); this names the pass, if it is one.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python benchmarks/probes/rank_memory.py --layers=8 2> log.txt
    python benchmarks/probes/pass_times.py log.txt [--top=20]

A compile whose passes sum to far less than its wall time spends it outside the HLO passes
(LLVM / PTX / Triton code generation, autotuning).
"""

from __future__ import annotations

import collections
import re
import sys

PASS_LINE = re.compile(r"HLO pass: (\S+) time: (\d+) us")


def pass_times(lines) -> tuple[collections.Counter, collections.Counter]:
    """-> (microseconds per pass name, runs per pass name)."""
    total, runs = collections.Counter(), collections.Counter()
    for line in lines:
        match = PASS_LINE.search(line)
        if match:
            total[match.group(1)] += int(match.group(2))
            runs[match.group(1)] += 1
    return total, runs


def main(argv: list[str]) -> int:
    paths = [a for a in argv[1:] if not a.startswith("--")]
    top = int(next((a.split("=")[1] for a in argv if a.startswith("--top=")), 20))
    if len(paths) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(paths[0], errors="replace") as f:
        total, runs = pass_times(f)
    if not total:
        print(f"error: no 'HLO pass: ... time:' lines in {paths[0]} (was TF_CPP_VMODULE=hlo_pass_pipeline=1 set?)", file=sys.stderr)
        return 2
    print(f"all passes: {sum(total.values()) / 1e6:.2f} s over {sum(runs.values())} runs")
    for name, us in total.most_common(top):
        print(f"{us / 1e6:10.3f} s  {runs[name]:6d} runs  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
