"""Where a decode step's fresh buffers live, step after step: which of them move.

XLA re-records a decode program's CUDA graph on every run in which a buffer its commands use has
moved, and on the H200 HiSparse's c = 1 program at 61 layers moves 8-13 of them every step
(22-33 ms a re-record; docs/PERFORMANCE.md, twelfth session) while the baseline's, compiled
twice and run in turn, moves none. XLA's log gives only the count. A runner given a
BufferAddressLog records the device address of each step's fresh inputs and outputs (per cache
kind, batch bucket and program copy), so a run shows which ones move; what the count has beyond
them is the program's temp buffer, which Python cannot see.

The addresses are read right after the step is dispatched (`jax.Array.unsafe_buffer_pointer`),
without waiting for it, and no reference is kept, so the log does not change when buffers are
freed (which would change where the next step's land).
"""

from __future__ import annotations

from collections import defaultdict

import jax


def _address(x) -> int | None:
    """The device address of a single-device jax.Array; None for anything else."""
    if not isinstance(x, jax.Array) or len(x.sharding.device_set) != 1:
        return None
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # e.g. a deleted array: no address to compare
        return None


class BufferAddressLog:
    """Addresses of each decode step's inputs and outputs, and how often each one moved."""

    def __init__(self):
        self.records: list[dict] = []

    def record(self, program: tuple, inputs: dict, outputs: dict) -> None:
        """program: (cache kind, bucket b, copy) of the step just dispatched; inputs and outputs:
        its fresh arrays by name (pytrees; not the donated cache, which keeps its place)."""
        record = dict(program=program)
        for side, tree in (("inputs", inputs), ("outputs", outputs)):
            leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
            record[side] = [_address(x) for _, x in leaves]
            record[f"{side}_names"] = [jax.tree_util.keystr(path) for path, _ in leaves]
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    def moves(self) -> list[dict]:
        """Per program: its runs, and for each input and output (by name) how many runs found it
        somewhere else than the same program's run before."""
        by_program = defaultdict(list)
        for record in self.records:
            by_program[record["program"]].append(record)
        out = []
        for program, runs in by_program.items():
            row = dict(program=[str(p) for p in program], runs=len(runs))
            for side in ("inputs", "outputs"):
                addresses = [run[side] for run in runs]
                row[f"{side}_moved"] = {
                    name: sum(1 for before, now in zip(addresses, addresses[1:]) if before[i] is not None and before[i] != now[i])
                    for i, name in enumerate(runs[0][f"{side}_names"])
                }
            out.append(row)
        return out
