"""The hottest frames of a py-spy raw profile (`py-spy record -f raw`: one collapsed stack per
line, frames joined by ';', then a sample count): per frame, the samples whose stack holds it
(inclusive) and the samples where it is the leaf (self). Names where a slow compile spends time.

    python benchmarks/probes/spy_top.py spy.txt [--top=40]
"""

from __future__ import annotations

import collections
import sys


def frame_counts(lines) -> tuple[collections.Counter, collections.Counter, int]:
    """-> (inclusive samples per frame, self samples per frame, total samples)."""
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f.split(" (")[0] for f in stack.split(";")]  # drop "(file:line)"
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        leaf[frames[-1]] += n
    return inclusive, leaf, total


def main(argv: list[str]) -> int:
    paths = [a for a in argv[1:] if not a.startswith("--")]
    top = int(next((a.split("=")[1] for a in argv if a.startswith("--top=")), 40))
    if len(paths) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(paths[0], errors="replace") as f:
        inclusive, leaf, total = frame_counts(f)
    print(f"{total} samples")
    print("inclusive:")
    for name, n in inclusive.most_common(top):
        print(f"{100 * n / total:6.1f}%  {name[:150]}")
    print("self:")
    for name, n in leaf.most_common(top // 2):
        print(f"{100 * n / total:6.1f}%  {name[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
