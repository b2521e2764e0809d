"""Flax NNX DSA models (DeepSeek-V3.2, GLM-5.x): modules, checkpoint loading, decoding."""
