#!/usr/bin/env bash
# The pure-Python wheels the H200 machine lacks for the fp8 MoE route (tokamax 0.0.17 and what it
# imports) and for jax-triton, into .whl/ (git-ignored), ~6 MB. The machine has
# no network: carry .whl with the device call and install with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# xprof (32 MB, imported by tokamax at import time, used only by its autotuner) is replaced by an
# import-only stub built here (xprof_stub/).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for spec in tokamax==0.0.17 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 pydantic==2.14.4 pydantic-core==2.50.5 \
            typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0 tensorboardx==2.6.5 jax-triton==0.3.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d .whl "$spec"
done
WHEEL_DIR=.whl python3 benchmarks/gpu_wheels/make_xprof_stub.py
# py-spy's static binary, for benchmarks/probes/compile_profile.sh (native sampling of a compile)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d /tmp/pyspy py-spy==0.4.3 \
  && python3 -c "import zipfile, glob; z = zipfile.ZipFile(glob.glob('/tmp/pyspy/py_spy-*.whl')[0]); open('.whl/py-spy', 'wb').write(z.read(next(n for n in z.namelist() if n.endswith('/scripts/py-spy') or n.endswith('bin/py-spy'))))" \
  && chmod +x .whl/py-spy
du -sh .whl
