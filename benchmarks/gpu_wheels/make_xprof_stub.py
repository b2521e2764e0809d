"""Builds .whl/hisparse_xprof_stub-0.0.1-py3-none-any.whl from stubs/xprof (pure stdlib), so the
one `pip install --no-index --no-deps --target ... whl/*.whl` line also installs the stub.

    python3 benchmarks/gpu_wheels/make_xprof_stub.py
"""

import base64
import hashlib
import os
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME, VERSION = "hisparse_xprof_stub", "0.0.1"
DIST = f"{NAME}-{VERSION}.dist-info"
OUT = os.path.join(os.environ.get("WHEEL_DIR", ".whl"), f"{NAME}-{VERSION}-py3-none-any.whl")


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def main():
    files = {}
    for root, _, names in os.walk(os.path.join(HERE, "xprof_stub")):
        for name in sorted(names):
            if name.endswith(".py"):
                full = os.path.join(root, name)
                files["xprof/" + os.path.relpath(full, os.path.join(HERE, "xprof_stub"))] = open(full, "rb").read()
    files[f"{DIST}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        "Summary: import-only stand-in for xprof (tokamax imports it; see xprof/__init__.py)\n"
    ).encode()
    files[f"{DIST}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: make_wheel.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{DIST}/top_level.txt"] = b"xprof\n"
    record = [record_line(p, d) for p, d in files.items()] + [f"{DIST}/RECORD,,"]
    files[f"{DIST}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(OUT, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    print(OUT)


if __name__ == "__main__":
    main()
