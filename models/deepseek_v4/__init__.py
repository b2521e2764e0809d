"""The DeepSeek-V4 family: model.py (compressed sparse attention, hyper-connections, MoE),
loading.py, decoding.py (caches, decode, HiSparse over the CSA entries), runner.py (serving),
family.py (what the registry knows)."""
