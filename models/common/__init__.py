"""Building blocks every model family shares: layers, RoPE, the DeepSeek MoE, tensor/expert
parallel placement, the safetensors checkpoint reader and loading loop, input checks, the family
descriptor and the engine runner contract (runner.py). Nothing here imports a family or the
registry."""
