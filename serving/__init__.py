"""The serving application on top of the library and the models: engine, admission, workloads,
telemetry, plots, synthetic studies, PD disaggregation and run_decode.py's logic (cli.py).

Nothing below it (models/, hisparse_jax/, pallas_kernels/) imports it (docs/architecture.md,
tests/test_layering.py).
"""
