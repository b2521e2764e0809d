"""Stand-in for the `xprof` package (hisparse_jax MoE work, not the real xprof).

tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` at import time
(tokamax/_src/benchmarking.py L40) and calls it only inside its own benchmarking / autotuning
(`compute_kernel_stats`). The real xprof wheel is 32 MB (100 MB unpacked) and pulls duckdb,
google-cloud-storage, gviz-api, cheroot, fire ...; carrying it to the GPU machine buys nothing for
`tokamax.ragged_dot` with an explicit implementation and config. This stub makes the import
succeed; tokamax's autotuner (which needs the kernel-stats tool) raises instead.
"""

__version__ = "0.0.0+hisparse.stub"
