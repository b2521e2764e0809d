"""The serving application on top of the library: engine, admission, workloads, telemetry,
plots, synthetic studies, PD disaggregation and run_decode.py's logic (cli.py).

It is the only layer that imports `models/`; nothing in hisparse_jax/ outside this package,
pallas_kernels/ or models/ imports it (docs/architecture.md, tests/test_layering.py).
"""
