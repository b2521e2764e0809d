"""Stub of xprof's kernel-stats tool: see xprof/__init__.py."""


def compute_kernel_stats(*args, **kwargs):
    """tokamax's benchmarking/autotuning summary; not available with the stub."""
    raise NotImplementedError(
        "xprof is a stub here (hisparse_jax carries it instead of the 32 MB wheel): tokamax "
        "autotuning/benchmarking is unavailable; pass an explicit config to tokamax ops."
    )
