"""The MiniMax-M3 family: model.py (block-sparse MHA), hisparse.py (HiSparse over the sparse
layers' K/V), loading.py, runner.py (serving), family.py (what the registry knows)."""
