"""The recipe: its typed schema and loading (`recipe`), every check of it (`checks`), the YAML machinery
(`schema`) and files with overrides (`files`), and the values derived from it once, at load: the answer
format (`answer_format`) and the placement plan (`placement_plan`). Everything else reads a recipe
through the names handed on here."""

from anytime.config.recipe import (AlgorithmConfig, BudgetConfig, DataConfig, EvalConfig, LearnerConfig,
                                   LoggingConfig, LoRAConfig, ModelConfig, PipelineConfig, Recipe, RecipeError,
                                   RolloutConfig, SFTConfig, SummaryConfig, TrainerConfig, load_recipe,
                                   parse_override, recipe_from_dict, recipe_reference, schema_keys)

__all__ = ["AlgorithmConfig", "BudgetConfig", "DataConfig", "EvalConfig", "LearnerConfig", "LoggingConfig",
           "LoRAConfig", "ModelConfig", "PipelineConfig", "Recipe", "RecipeError", "RolloutConfig", "SFTConfig",
           "SummaryConfig", "TrainerConfig", "load_recipe", "parse_override", "recipe_from_dict", "recipe_reference",
           "schema_keys"]
