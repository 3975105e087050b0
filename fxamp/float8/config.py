"""Float8 training as configuration: the recipes (data) and `Float8Config` (validated, frozen).

A recipe says, for the three GEMMs of a matmul (the output, grad_input and grad_weight), which
float8 dtype each operand is cast to and at which granularity its scale is computed. The
recipes are torchao's (`torchao.float8.Float8LinearConfig.from_recipe_name`): `tensorwise`
(one scale per tensor, e4m3 forward operands and e5m2 gradients), `rowwise` (one scale per
row of the left operand and per column of the right one, over the contraction dim, e4m3
everywhere, scales rounded down to powers of two) and `rowwise_with_gw_hp` (rowwise for the
output GEMM; grad_input from a rowwise gradient and a tensorwise weight; the grad_weight GEMM
in the model's dtype, not float8). The block-scaled recipes `mxfp8` and `nvfp4` (issue 39) quantize
every operand of all three GEMMs in blocks along its own reduction dim (fxamp/float8/block_gemm.py;
docs/float8.md, "Block-scaled formats"), emulated only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from fxamp.errors import ConfigError
from fxamp.float8.mxfp8 import MX_SCALE_MODES

__all__ = ["Float8Config", "Recipe", "RECIPES", "SCALINGS", "MX_SCALE_MODES", "E4M3", "E5M2",
           "as_float8_config", "check_float8_support", "recipe_refusal"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SCALINGS = ("dynamic", "delayed")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The float8 dtypes and scale granularity of one recipe (torchao's semantics).

    Attributes:
        name: a key of `RECIPES`.
        input, weight, grad_output: float8 dtypes of the three GEMM operands (for a
            block-scaled recipe, MXFP8's element dtype; NVFP4's elements are e2m1).
        rowwise: scales per row/column over the contraction dim, else one per tensor.
        pow2_scales: round every scale down to a power of two.
        fast_accum_output: `use_fast_accum` of the output GEMM (the gradient GEMMs never).
        weight_tensorwise_for_grad_input: the weight of the grad_input GEMM gets one scale
            for the tensor even in a rowwise recipe.
        grad_weight_hp: the grad_weight GEMM runs in the operands' own dtype, not float8.
        block: "mxfp8" or "nvfp4" for a block-scaled recipe (every operand of the three
            GEMMs in blocks along its reduction dim, fxamp/float8/block_gemm.py), else None.
    """

    name: str
    input: torch.dtype
    weight: torch.dtype
    grad_output: torch.dtype
    rowwise: bool
    pow2_scales: bool
    fast_accum_output: bool = True
    weight_tensorwise_for_grad_input: bool = False
    grad_weight_hp: bool = False
    block: Optional[str] = None


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe("tensorwise", E4M3, E4M3, E5M2, rowwise=False, pow2_scales=False),
    "rowwise": Recipe("rowwise", E4M3, E4M3, E4M3, rowwise=True, pow2_scales=True),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", E4M3, E4M3, E4M3, rowwise=True,
                                 pow2_scales=True, weight_tensorwise_for_grad_input=True,
                                 grad_weight_hp=True),
    "mxfp8": Recipe("mxfp8", E4M3, E4M3, E4M3, rowwise=False, pow2_scales=True, block="mxfp8"),
    "nvfp4": Recipe("nvfp4", E4M3, E4M3, E4M3, rowwise=False, pow2_scales=False, block="nvfp4"),
}
BLOCK_RECIPES = tuple(name for name, r in RECIPES.items() if r.block)


@dataclasses.dataclass(frozen=True)
class Float8Config:
    """Which GEMMs run in float8, and how.

    Attributes:
        recipe: "tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8" or "nvfp4" (`RECIPES`).
        scaling: "dynamic" (scales from the tensor itself, every step) or "delayed" (scales
            from an amax history kept in device buffers; tensorwise only).
        history_len: length of the amax history for delayed scaling.
        skip_modules: module paths (fnmatch globs such as "layers.*.attn.*") or class names
            whose GEMMs stay in the model dtype (torchao's `module_filter_fn`, as data).
        min_dim: GEMMs whose K or N is smaller stay in the model dtype (too small to gain).
        batched_activations: batched GEMMs between two activations (attention's q @ k^T and
            attn @ v) run in float8 too; off by default (Note [Batched float8 GEMMs]).
        max_batch: batched GEMMs with more entries stay in the model dtype (each entry is
            one `torch._scaled_mm` call in the graph).
        mx_scale_mode: how recipe="mxfp8" rounds its power-of-two block scales, one of
            `MX_SCALE_MODES` (torchao's `ScaleCalculationMode`; "rceil" is torchtitan's
            default). Only the default for the other recipes.
        nvfp4_rht_signs: recipe="nvfp4" only: 16 signs (+1/-1) of the random Hadamard
            transform torchao's NVFP4 training recipe applies to the grad_weight GEMM's
            operands (`NVFP4_RHT_SIGNS` is a fixed choice); None (default) rotates nothing
            (Note [The Hadamard transform of NVFP4's grad_weight GEMM] in block_gemm.py).
        nvfp4_stochastic_rounding: recipe="nvfp4" only: round the output gradient's two
            quantizations (both backward GEMMs) stochastically, as torchao's and
            TransformerEngine's NVFP4 training recipes do; the noise comes from a counter the
            model holds as a buffer (Note [The seed of NVFP4's stochastic rounding]).
    """

    recipe: str = "tensorwise"
    scaling: str = "dynamic"
    history_len: int = 16
    skip_modules: tuple[str, ...] = ()
    min_dim: int = 64
    batched_activations: bool = False
    max_batch: int = 64
    mx_scale_mode: str = "rceil"
    nvfp4_rht_signs: Optional[tuple[int, ...]] = None
    nvfp4_stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.skip_modules, list):
            object.__setattr__(self, "skip_modules", tuple(self.skip_modules))
        if self.recipe not in RECIPES:
            raise ConfigError(f"float8 recipe {self.recipe!r} is not one of "
                              f"{', '.join(map(repr, RECIPES))}")
        if self.scaling not in SCALINGS:
            raise ConfigError(f"float8 scaling={self.scaling!r} is not one of 'dynamic', "
                              "'delayed'")
        if self.scaling == "delayed" and self.recipe != "tensorwise":
            raise ConfigError(f"float8 scaling='delayed' works with recipe='tensorwise', not "
                              f"{self.recipe!r} (one amax per tensor is what a history keeps)")
        self._check_mx_scale_mode()
        self._check_rht_signs()
        self._check_stochastic()
        if type(self.batched_activations) is not bool:
            raise ConfigError(f"float8 batched_activations={self.batched_activations!r} must "
                              "be True or False")
        for name in ("history_len", "min_dim", "max_batch"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"float8 {name}={value!r} must be a positive int")
        if isinstance(self.skip_modules, str) or not all(
                isinstance(p, str) for p in self.skip_modules):
            raise ConfigError(f"float8 skip_modules={self.skip_modules!r} must be a tuple of "
                              "module paths (globs allowed) or class names")

    def _check_mx_scale_mode(self) -> None:
        if self.mx_scale_mode not in MX_SCALE_MODES:
            raise ConfigError(f"float8 mx_scale_mode={self.mx_scale_mode!r} is not one of "
                              f"{', '.join(map(repr, MX_SCALE_MODES))}")
        if self.mx_scale_mode != "rceil" and self.recipe != "mxfp8":
            raise ConfigError(f"float8 mx_scale_mode={self.mx_scale_mode!r} applies to "
                              f"recipe='mxfp8', not {self.recipe!r} (leave it 'rceil')")

    def _check_rht_signs(self) -> None:
        signs = self.nvfp4_rht_signs
        if signs is None:
            return
        if self.recipe != "nvfp4":
            raise ConfigError(f"float8 nvfp4_rht_signs applies to recipe='nvfp4', not "
                              f"{self.recipe!r} (leave it None)")
        if (isinstance(signs, (str, bytes)) or not hasattr(signs, "__len__") or len(signs) != 16
                or any(type(s) is not int or s not in (1, -1) for s in signs)):
            raise ConfigError(f"float8 nvfp4_rht_signs={signs!r} must be 16 ints, each +1 or -1 "
                              "(e.g. fxamp.float8.nvfp4.NVFP4_RHT_SIGNS)")
        object.__setattr__(self, "nvfp4_rht_signs", tuple(signs))

    def _check_stochastic(self) -> None:
        sr = self.nvfp4_stochastic_rounding
        if type(sr) is not bool:
            raise ConfigError(f"float8 nvfp4_stochastic_rounding={sr!r} must be True or False")
        if sr and self.recipe != "nvfp4":
            raise ConfigError(f"float8 nvfp4_stochastic_rounding applies to recipe='nvfp4', "
                              f"not {self.recipe!r} (leave it False)")

    @property
    def spec(self) -> Recipe:
        return RECIPES[self.recipe]


def as_float8_config(value: Union[None, str, Float8Config]) -> Optional[Float8Config]:
    """`float8=` as the entry points take it: None, a recipe name or a Float8Config."""
    if value is None or isinstance(value, Float8Config):
        return value
    if isinstance(value, str):
        return Float8Config(recipe=value)
    raise ConfigError(f"float8={value!r} must be None, a recipe name "
                      f"({', '.join(map(repr, RECIPES))}) or a fxamp.Float8Config")


def recipe_refusal(recipe: str, device_type: str, dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why this torch build cannot run float8 `recipe` on `device_type` for a model in
    `dtype` ("torch._scaled_mm refused a row-scaled float8 GEMM (<its error>)"), or None when
    it can: `torch._scaled_mm` is probed with the recipe's scales. The one question both the
    float8 pass (check_float8_support) and the planner ask."""
    from fxamp._compat import scaled_mm_refusal  # lazily: _compat imports torch._dynamo

    # Note [Block-scaled recipes are emulated only] (fxamp/float8/block_gemm.py): every device
    if RECIPES[recipe].block:
        return None
    rowwise = RECIPES[recipe].rowwise
    why = scaled_mm_refusal(device_type, rowwise,
                            torch.bfloat16 if rowwise else (dtype or torch.float32))
    if why is None:
        return None
    return f"torch._scaled_mm refused a {'row' if rowwise else 'tensor'}-scaled float8 GEMM ({why})"


def _compiler_refusal(recipe: str, device_type: str, compiler: Any) -> Optional[str]:
    # torch 2.11's Inductor C++ code generation has no float8_e8m0fnu, MXFP8's block scales
    # ("torch.float8_e8m0fnu missing from torch._inductor.codegen.cpp.DTYPE_TO_CPP"); 2.13 has
    # it (docs/float8.md, "Known differences")
    if (RECIPES[recipe].block == "mxfp8" and compiler == "inductor" and device_type == "cpu"
            and "float8_e8m0fnu" not in _cpp_dtypes()):
        return ("Inductor's C++ code generation in this torch has no float8_e8m0fnu, the "
                "recipe's block scales")
    return None


def _cpp_dtypes() -> frozenset[str]:
    from fxamp._compat import cpp_dtypes  # lazily: _compat imports torch._dynamo

    return cpp_dtypes()


def check_float8_support(f8: Optional[Float8Config], device_type: str,
                         dtype: Optional[torch.dtype], compiler: Any = None) -> None:
    """Refuse a float8 config that this torch build cannot run on `device_type` (before
    anything is changed); with `compiler`, also one that compiler cannot compile here."""
    if f8 is None:
        return
    why = _compiler_refusal(f8.recipe, device_type, compiler)
    if why is not None:
        raise ConfigError(f"float8 recipe {f8.recipe!r} cannot be compiled by Inductor for "
                          f"{device_type!r} with torch {torch.__version__}: {why}. Use "
                          "compiler='aot_eager' (the same numerics, emulated), torch >= 2.13, "
                          "or recipe='nvfp4'")
    why = recipe_refusal(f8.recipe, device_type, dtype)
    if why is None:
        return
    if f8.spec.block:
        fix = f"recipe='tensorwise' or 'rowwise', the CPU for {f8.recipe!r}"
    else:
        fix = ("recipe='tensorwise'" + ("" if f8.spec.rowwise else " on a GPU with compute "
                                        "capability 8.9+") + ", a newer torch")
    raise ConfigError(f"float8 recipe {f8.recipe!r} cannot run on {device_type!r} with torch "
                      f"{torch.__version__}: {why}. Use {fix}, or float8=None")
