"""Float8 GEMMs on top of an opt level (docs/float8.md): recipes, config, the GEMM itself."""

from fxamp.float8.config import RECIPES, Float8Config, Recipe

__all__ = ["Float8Config", "Recipe", "RECIPES"]
