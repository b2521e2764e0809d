"""What a DSA model can take, checked before anything is built (no JAX): used by its registry entry
(family.py) and by greedy generation (generate.py)."""

from __future__ import annotations

from configs.model import DSAModelConfig


def check_hisparse(config: DSAModelConfig, hisparse) -> None:
    """HiSparse settings (a HiSparseConfig) the model can take: ValueError naming the value at fault."""
    if hisparse.top_k != config.index_topk:
        raise ValueError(f"HiSparse top_k ({hisparse.top_k}) must equal the model's index_topk ({config.index_topk})")
