"""The DSA family: DeepSeek-V3.2 and GLM-5.x (MLA attention with the DSA lightning indexer).

model.py (the Flax model), mla.py, indexer.py (its blocks), loading.py (HF checkpoints),
decoding.py (cache and decode step), runner.py (the serving runner), generate.py (greedy
generation), footprint.py (device bytes per request), family.py (what the registry knows)."""
