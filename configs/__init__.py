"""Model configurations: configs.model.DSAModelConfig and its named constructors."""
