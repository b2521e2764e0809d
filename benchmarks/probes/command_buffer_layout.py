"""Which of a decode step's ops run inside XLA command buffers (CUDA graphs) and which the host
launches one by one? Reads the optimised HLO that bench_serving dumps (hlo_dump/, kept
as hlo_dump.tgz with --keep_hlo_dump) and prints, per decode-step module: the entry
computation's thunk-producing ops, how many command buffers there are and how many ops they hold
(by kind: a while, conditional or nested call inside one can make XLA re-record it every run),
and the ops outside them by kind (custom-call target, copy, ...), with the ones that split the
command buffers most. An engine whose layers each break the graph pays a host launch per break.
jaxlib 0.11.2 forms its command buffers from the thunk sequence after the optimised-HLO dump, so
on its dumps this finds none (2026-12-04); command_buffer_updates.py reads XLA's log instead.

    python benchmarks/probes/command_buffer_layout.py docs/perf/<run>/hlo_dump.tgz [--module_re=decode_step]
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import tarfile

# Ops that produce no thunk (aliases, tuples, constants folded into the buffer assignment).
NO_THUNK = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "opt-barrier", "after-all"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
CALLEE = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
TARGET = re.compile(r'custom_call_target="([^"]+)"')


def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines; the entry's name is stored under "ENTRY" too."""
    comps, name, body = {}, None, []
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name, body = header.group(2), []
            comps[name] = body
            if header.group(1):
                comps["ENTRY"] = body
        elif line.startswith("}"):
            name = None
        elif name is not None:
            body.append(line)
    return comps


def op_kind(opcode: str, rest: str) -> str:
    """A readable kind: the custom call's target, else the opcode."""
    target = TARGET.search(rest)
    return f"custom-call:{target.group(1)}" if opcode == "custom-call" and target else opcode


def layout(text: str) -> dict:
    """The entry computation's thunk ops: command buffers (ops inside each) and ops outside."""
    comps = computations(text)
    inside, outside, breaks = [], collections.Counter(), collections.Counter()
    inside_kinds = collections.Counter()  # while / conditional / copy here: commands XLA may re-record every run
    previous_was_buffer = False
    for line in comps.get("ENTRY", []):
        match = INSTRUCTION.match(line)
        if not match or match.group(3) in NO_THUNK:
            continue
        opcode, rest = match.group(3), match.group(4)
        callee = CALLEE.search(rest)
        if opcode == "call" and callee and callee.group(1).startswith("command_buffer"):
            ops = [m for m in (INSTRUCTION.match(x) for x in comps.get(callee.group(1), [])) if m and m.group(3) not in NO_THUNK]
            inside.append(len(ops))
            inside_kinds.update(op_kind(m.group(3), m.group(4)) for m in ops)
            previous_was_buffer = True
            continue
        kind = op_kind(opcode, rest)
        outside[kind] += 1
        if previous_was_buffer:
            breaks[kind] += 1  # the op that ended a command buffer
        previous_was_buffer = False
    return dict(command_buffers=len(inside), ops_in_buffers=sum(inside), largest_buffer=max(inside, default=0),
                inside_by_kind=dict(inside_kinds.most_common()),
                ops_outside=sum(outside.values()), outside_by_kind=dict(outside.most_common()),
                buffer_enders=dict(breaks.most_common(10)))  # fmt: skip


def dumped_modules(path: str, module_re: str):
    """(file name, optimised HLO text) of each dumped module matching module_re."""
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.name.endswith("after_optimizations.txt") and re.search(module_re, member.name):
                yield member.name, io.TextIOWrapper(tar.extractfile(member)).read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", help="hlo_dump.tgz")
    parser.add_argument("--module_re", default="decode_step")
    args = parser.parse_args()
    for name, text in dumped_modules(args.dump, args.module_re):
        print(name.split("/")[-1], layout(text))


if __name__ == "__main__":
    main()
