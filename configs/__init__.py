"""Model configurations: DSAModelConfig and its named constructors."""

from configs.model import DSAModelConfig, RopeConfig, UnsupportedModelError

__all__ = ["DSAModelConfig", "RopeConfig", "UnsupportedModelError"]
