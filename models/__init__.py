"""Model families as packages (models/dsa, models/deepseek_v4, models/minimax_m3), the blocks they
share (models/common) and the registry on top (models/registry.py: config.json model_type -> family)."""
