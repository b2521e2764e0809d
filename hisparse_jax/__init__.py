"""hisparse_jax: HiSparse (hierarchical sparse attention) for JAX, the library.

The full KV cache of each request in pinned host memory, a small hot buffer per request on the
device, and each decode step's selected rows that miss swapped in: config.HiSparseConfig,
state.HiSparseState / FullKVState, attention_layer.attention_layer (one DSA layer's decode
attention), kv_cache_ops (request lifecycle), host_pages, sharding. Importing the package loads
nothing else (no JAX work, no models, no serving).
"""

__version__ = "0.2.0"
