"""Which parameters of a compiled program XLA copies, from an optimised-HLO dump.

    python benchmarks/probes/state_copies.py DUMP [--module=greedy_decode_step]

DUMP: a directory or .tgz written with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=..."
(rank_h200.sh HLO_DUMP=1), or one `*after_optimizations.txt` file. For each matching module:
its parameters that the entry computation copies (`copy` / `copy-start` of the parameter, through
bitcasts, tuple elements and earlier copies), with shape and bytes, how many parameters the
module aliases to outputs, and what its entry runs by kind (entry_census). Why: a donated state array that XLA copies every step comes back in a
new buffer, so its address moves between steps, and every CUDA-graph command using it must be
updated (the c = 1 re-records of docs/PERFORMANCE.md, 2026-12-04 ninth session). Exit 2 when no
module matches.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tarfile
import tempfile
from collections import Counter

BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
         "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\([^()]*\)|\S+?)\s+([\w-]+)\((.*?)\)")
_PASS_THROUGH = ("bitcast", "get-tuple-element", "copy", "copy-done")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `s32[3,4,20]{2,1,0}`; of a tuple (a copy-start's), its first
    element; unknown types: 0."""
    match = re.match(r"\(?(\w+)\[([\d,]*)\]", shape)
    if not match or match.group(1) not in BYTES:
        return 0
    count = 1
    for dim in filter(None, match.group(2).split(",")):
        count *= int(dim)
    return count * BYTES[match.group(1)]


def entry_lines(text: str) -> list[str]:
    """The lines of the module's ENTRY computation."""
    start = text.index("\nENTRY")
    end = text.find("\n}", start)
    return text[start:end].splitlines()[1:]


def copied_parameters(text: str) -> tuple[list[dict], int, int]:
    """(copies, parameters, aliased parameters) of one optimised module: each copy of a parameter
    as {parameter, name, shape, bytes, op, instruction}."""
    params, origin, copies = {}, {}, []
    for line in entry_lines(text):
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, op, operands = match.groups()
        first = re.match(r"%(\S+?)[,)\s]|%(\S+)$", operands.strip())
        operand = (first.group(1) or first.group(2)) if first else None
        if op == "parameter":
            params[name] = int(operands)
            origin[name] = name
        elif op in _PASS_THROUGH and operand in origin:
            origin[name] = origin[operand]
        if op in ("copy", "copy-start") and operand in origin:
            source = origin[operand]
            copies.append(dict(parameter=params[source], name=source, shape=shape, bytes=shape_bytes(shape), op=op, instruction=name))
        if op == "copy-start" and operand in origin:  # its copy-done (a pass-through) names the copy
            origin[name] = origin[operand]
    header = text[: text.find("\n")]
    aliased = len(re.findall(r"\{[\d, ]*\}: \(\d+", header))
    return copies, len(params), aliased


def entry_census(text: str) -> Counter:
    """What the module's ENTRY computation runs, by kind: each instruction's opcode, a fusion's
    kind (with its backend kind when the config names one, e.g. `fusion kCustom __triton_gemm`),
    a custom call's target. Why: these are the thunks a command buffer records, so two programs'
    censuses show which commands one has that the other lacks (the c = 1 re-records, eleventh
    session). Parameters, constants, tuples and bitcasts run nothing and are left out."""
    census = Counter()
    for line in entry_lines(text):
        match = _INSTRUCTION.match(line)
        if not match or match.group(3) in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast"):
            continue
        op = match.group(3)
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            backend = re.search(r'"kind":"(\w+)"', line)
            op = " ".join(filter(None, (op, kind and kind.group(1), backend and backend.group(1))))
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', line)
            op = f"{op} {target.group(1) if target else '?'}"
        census[op] += 1
    return census


def module_files(dump: str, module: str) -> list[str]:
    """The optimised-HLO text files of modules whose name contains `module`."""
    if os.path.isfile(dump) and not dump.endswith((".tgz", ".tar.gz")):
        return [dump]
    if os.path.isfile(dump):
        directory = tempfile.mkdtemp(prefix="hlo_dump_")
        with tarfile.open(dump) as archive:
            archive.extractall(directory, filter="data")
        dump = directory
    files = glob.glob(os.path.join(dump, "**", "*after_optimizations.txt"), recursive=True)
    return sorted(f for f in files if module in os.path.basename(f))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump")
    parser.add_argument("--module", default="greedy_decode_step")
    args = parser.parse_args(argv)
    files = module_files(args.dump, args.module)
    if not files:
        print(f"no optimised module matching {args.module!r} under {args.dump}", file=sys.stderr)
        return 2
    for path in files:
        with open(path) as f:
            text = f.read()
        copies, num_params, aliased = copied_parameters(text)
        total = sum(c["bytes"] for c in copies)
        print(f"{os.path.basename(path)}: {num_params} parameters, {aliased} aliased to outputs, "
              f"{len(copies)} copies of parameters ({total / 1e6:.3f} MB)")  # fmt: skip
        for c in copies:
            print(f"  param {c['parameter']:>4} {c['name']:<40} {c['op']:<10} {c['shape']:<32} {c['bytes'] / 1e6:>10.3f} MB")
        census = entry_census(text)
        print(f"  entry runs {sum(census.values())}: " + ", ".join(f"{op} {n}" for op, n in census.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
