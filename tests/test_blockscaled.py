"""Block-scaled numerics (fxamp/float8/mxfp8.py, nvfp4.py, blockscaled.py; issue 39).

Two halves: float64 references and error bounds that need nothing but torch (CI always runs
them), and bit-for-bit comparisons with torchao 0.18's own functions on CPU, skipped where
torchao is not installed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fxamp.float8 import Float8Config
from fxamp.float8.blocks import block_refusal, swizzle_block_scales
from fxamp.float8.blockscaled import BlockFormat, blockscaled_mm, fake_quantize, linear_refusal
from fxamp.float8.mxfp8 import MX_SCALE_MODES, mx_dequantize, mx_quantize
from fxamp.float8.nvfp4 import (e2m1_decode, e2m1_encode, hadamard_transform, nvfp4_dequantize,
                                nvfp4_quantize, pack_e2m1, unpack_e2m1)

SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1)
E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_GRID = E4M3_GRID[torch.isfinite(E4M3_GRID) & (E4M3_GRID >= 0)].unique()


def _awkward(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    # Magnitudes spread over 60 decades across the blocks, an all-zero block, a block of float32
    # denormals, and a block of values within 2**-119 of zero (e8m0's smallest scale).
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 30, cols)
    x[0, :32] = 0
    x[1, :32] = 1e-42
    x[2, :32] = torch.randn(32, generator=g) * 2.0 ** -125
    return x


# --- float64 references: no torchao needed --------------------------------------------------

def _e4m3_round(v: torch.Tensor) -> torch.Tensor:
    # Round-to-nearest onto e4m3's finite grid in float64 (grid index = code), ties to the even
    # code, saturating at 448.
    dist = (v.abs().clamp(max=448.0)[..., None] - E4M3_GRID).abs()
    even_tie = (dist == dist.min(-1, keepdim=True).values) & (torch.arange(len(E4M3_GRID)) % 2 == 0)
    pick = torch.where(even_tie.any(-1), even_tie.int().argmax(-1), dist.argmin(-1))
    return E4M3_GRID[pick] * v.sign()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_rceil_matches_a_float64_rederivation(dtype):
    # OCP MX with NVIDIA's rounding: scale 2**ceil(log2(amax / 448)), values rounded to nearest
    # even. Away from powers of two (where torchao's float32 log2 rounds, Note [MX scale
    # rounding]) the float64 rule and the implementation agree exactly.
    x = (torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
         * torch.logspace(-20, 20, 256)).to(dtype)
    q = mx_quantize(x, mode="rceil")
    blocks = x.double().reshape(16, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 448))
    expected = _e4m3_round(blocks / 2 ** exponent)
    assert torch.equal(q.scale.view(torch.uint8).long(), (exponent + 127).squeeze(-1).long())
    assert torch.equal(q.data.double().reshape(16, -1, 32), expected)


@pytest.mark.parametrize("mode", MX_SCALE_MODES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_mx_round_trip_error_is_bounded(mode, dim):
    # e4m3 keeps 3 mantissa bits: a value's error is at most 2**-4 of it, or half of the
    # smallest subnormal step (2**-10 of the block scale); floor-like modes saturate at 448
    # times the scale, so the block's largest values may lose up to 64 of those steps more.
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 3.7
    q = mx_quantize(x, dim=dim, mode=mode)
    back = mx_dequantize(q).double()
    scale = mx_dequantize(q._replace(data=torch.ones_like(q.data))).double()
    bound = torch.maximum(x.double().abs() * 2 ** -4, scale * 2 ** -10)
    if mode != "rceil":
        bound = bound + (x.double().abs() - 448 * scale).clamp(min=0)
    assert ((back - x.double()).abs() <= bound).all()
    assert q.scale.shape[q.dim] * 32 == x.shape[dim] and q.data.dtype == torch.float8_e4m3fn


def _nvfp4_bound(x: torch.Tensor, q, stochastic: bool = False) -> torch.Tensor:
    # With s the block's scale (e4m3 scale * tensor scale): e2m1's gaps are 0.5 s below s and at
    # most half the value above it; round-to-nearest errs by half a gap, stochastic rounding by
    # up to a whole one; values past 6 s saturate. 1.001: the float32 rounding of the scales.
    s = q.scale.movedim(q.dim, -1).double() * q.tensor_scale.double()
    s = s.repeat_interleave(16, dim=-1).movedim(-1, q.dim)
    mag = x.double().abs()
    half_gap = torch.maximum(0.25 * s, 0.25 * mag)
    return 1.001 * ((2 if stochastic else 1) * half_gap + (mag - 6 * s).clamp(min=0))


@pytest.mark.parametrize("rule", ["kernel", "emulated"])
@pytest.mark.parametrize("tiles", [False, True])
def test_nvfp4_round_trip_error_and_scales(rule, tiles):
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    x[:16, :16] *= 1e-3  # a block far below the tensor's amax
    q = nvfp4_quantize(x, dim=1, tile_dim=0 if tiles else None, rule=rule)
    assert ((nvfp4_dequantize(q).double() - x.double()).abs() <= _nvfp4_bound(x, q)).all()
    amax = x.double().abs().max()
    assert torch.isclose(q.tensor_scale.double(), amax / 2688, rtol=2 ** -23, atol=0)
    # each block scale is the ideal one (block amax / 6 / tensor scale) rounded to e4m3
    ideal = (x.double().abs().reshape(48, 4, 16).amax(-1) / 6 / (amax / 2688))
    if tiles:
        ideal = ideal.reshape(3, 16, 4).amax(1, keepdim=True).expand(3, 16, 4).reshape(48, 4)
    assert ((q.scale.double() - ideal).abs() <= ideal * 2 ** -4 + 2 ** -10).all()


def test_nvfp4_tiles_make_the_weight_and_its_transpose_agree():
    # torchao's 2-D weight blocks: the forward GEMM's W and the grad_input GEMM's W^T are
    # quantized once, so both GEMMs see the same values.
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(4))
    rows = nvfp4_dequantize(nvfp4_quantize(w, dim=1, tile_dim=0))
    cols = nvfp4_dequantize(nvfp4_quantize(w.t(), dim=0, tile_dim=1))
    assert torch.equal(rows, cols.t())
    scale = nvfp4_quantize(w, dim=1, tile_dim=0).scale.view(torch.uint8)
    assert torch.equal(scale, scale[::16].repeat_interleave(16, 0))


def test_nvfp4_scale_rules_differ_at_most_by_one_scale_step_and_rarely():
    # Note [NVFP4 scale rules]: 448 * 6 / amax against amax / (448 * 6) in float32.
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(15)) * torch.logspace(
        -2, 2, 512)
    kernel, emulated = nvfp4_quantize(x, rule="kernel"), nvfp4_quantize(x, rule="emulated")
    steps = (kernel.scale.view(torch.uint8).int() - emulated.scale.view(torch.uint8).int()).abs()
    assert steps.max() <= 1 and steps.float().mean() < 0.01
    assert torch.equal(kernel.tensor_scale, emulated.tensor_scale)


def test_tiles_on_either_gemm_operand():
    g = torch.Generator().manual_seed(16)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 48, generator=g)
    tiled, plain = BlockFormat(fmt="nvfp4", tiles=True), BlockFormat(fmt="nvfp4")
    out = blockscaled_mm(a, b, a_format=tiled, b_format=plain)
    a_dq = nvfp4_dequantize(nvfp4_quantize(a, dim=1, tile_dim=0))
    assert torch.equal(out, a_dq @ nvfp4_dequantize(nvfp4_quantize(b, dim=0)))
    with pytest.raises(ValueError, match="need other_dim"):
        fake_quantize(a, tiled, dim=1)


def test_e2m1_rounds_to_nearest_even():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(e2m1_decode(torch.arange(8, dtype=torch.uint8)), grid)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, -0.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4, -4, 6, -0.0]
    x = torch.linspace(-6, 6, 4801)
    nearest = (x.double().abs()[:, None] - grid.double()).abs().min(1).values
    assert torch.equal((e2m1_decode(e2m1_encode(x)).double() - x.double()).abs(), nearest)
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


@pytest.mark.parametrize("source", ["generator", "seed"])
def test_stochastic_rounding_is_unbiased_and_uses_no_global_state(source):
    # Every block's amax is 1, so its scale is exactly 1/6 and 0.37 lands at 2.22, between the
    # codes for 2 and 3: rounded up with probability 0.22, the mean stays 0.37.
    x = torch.full((64, 256), 0.37)
    x[:, ::16] = 1.0
    middle = x == 0.37
    rng_before = torch.get_rng_state()

    def draw(i):
        return (torch.Generator().manual_seed(i) if source == "generator"
                else torch.tensor([i], dtype=torch.int64))

    q0 = nvfp4_quantize(x, stochastic=draw(7))
    assert torch.equal(q0.data, nvfp4_quantize(x, stochastic=draw(7)).data)  # reproducible
    assert not torch.equal(q0.data, nvfp4_quantize(x, stochastic=draw(8)).data)
    back = nvfp4_dequantize(q0)[middle].double()
    nearest = nvfp4_dequantize(nvfp4_quantize(x))[middle].double()
    assert (back != nearest).any() and (back == nearest).any()  # both neighbours drawn
    assert abs(back.mean().item() - 0.37) < 0.37 * 0.02  # to-nearest is off by far more
    assert abs(nearest.mean().item() - 0.37) > 0.37 * 0.05
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert ((nvfp4_dequantize(q0).double() - x.double()).abs() <= _nvfp4_bound(x, q0, True)).all()


def test_hadamard_transform_is_orthogonal_and_rotates_gemm_operands_alike():
    # (in float32: the transform computes there)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(8, 64, generator=g), torch.randn(64, 24, generator=g)
    ra, rb = hadamard_transform(a, SIGNS, dim=1), hadamard_transform(b, SIGNS, dim=0)
    assert torch.allclose(ra.double() @ rb.double(), a.double() @ b.double(), rtol=0, atol=1e-5)
    assert torch.allclose(ra.norm(dim=1), a.norm(dim=1), rtol=1e-6, atol=0)
    assert not torch.allclose(ra, a, atol=0.1)
    with pytest.raises(ValueError, match="16 entries"):
        hadamard_transform(a, SIGNS[:8])


def _a_priori_bound(x: torch.Tensor, fmt: str, dim: int, tiles: bool = False) -> torch.Tensor:
    # Each element's quantization error bound in float64 from x alone (no fxamp scale):
    # MXFP8 (rceil) scales are below 2 * block amax / 448 and e4m3 errs by 2**-4 of a normal
    # value, 2**-10 of the scale below; NVFP4 scales are within 2**-4 of block amax / 6 (at
    # least 2**-6 * tensor scale), e2m1 errs by a quarter (of the scale or the value) and
    # saturation by up to a sixteenth of the block amax.
    block = 32 if fmt == "mxfp8" else 16
    mag = x.double().abs().movedim(dim, -1)
    bamax = mag.reshape(*mag.shape[:-1], -1, block).amax(-1, keepdim=True)
    if tiles:  # 2-D operand: the tile's other dim is the first one left
        bamax = bamax.reshape(-1, 16, *bamax.shape[1:]).amax(1, keepdim=True).expand(
            -1, 16, *bamax.shape[1:]).reshape(bamax.shape)
    bamax = bamax.expand(*bamax.shape[:-1], block).reshape(mag.shape)
    if fmt == "mxfp8":
        bound = torch.maximum(mag * 2 ** -4, 2 * bamax / 448 * 2 ** -10)
    else:
        s = torch.clamp(bamax * (1 + 2 ** -4) / 6, min=2 ** -6 * mag.max() / 2688)
        bound = torch.maximum(0.25 * s, 0.25 * mag) + bamax / 16
    return (1.001 * bound).movedim(-1, dim)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("batched", [False, True])
def test_gemm_against_a_float64_reference(fmt, batched):
    g = torch.Generator().manual_seed(6)
    a = torch.randn(*((2,) if batched else ()), 32, 64, generator=g)
    b = torch.randn(64, 48, generator=g) * 0.05
    fa, fb = BlockFormat(fmt=fmt), BlockFormat(fmt=fmt, tiles=fmt == "nvfp4")
    a, b = a.bfloat16(), b.bfloat16()
    out = blockscaled_mm(a, b, a_format=fa, b_format=fb, out_dtype=torch.float32)
    ad, bd = a.double(), b.double()
    err_a, err_b = _a_priori_bound(a, fmt, -1), _a_priori_bound(b, fmt, 0, tiles=fmt == "nvfp4")
    bound = err_a @ bd.abs() + ad.abs() @ err_b + err_a @ err_b
    slack = 64 * 2 ** -24 * ((ad.abs() + err_a) @ (bd.abs() + err_b))  # float32 accumulation
    assert ((out.double() - ad @ bd).abs() <= bound + slack).all()
    a_dq = fake_quantize(a, fa, dim=-1).double()
    b_dq = fake_quantize(b, fb, dim=0, other_dim=1).double()
    assert torch.allclose(out.double(), a_dq @ b_dq, rtol=0, atol=slack.max().item())


def test_gemm_with_hadamard_and_stochastic_grad_weight_operands():
    # torchao's grad_weight GEMM: grad_output^T @ input, both rotated along the tokens (M) and
    # grad_output rounded stochastically.
    g = torch.Generator().manual_seed(9)
    dy, x = torch.randn(64, 32, generator=g), torch.randn(64, 48, generator=g)
    fa = BlockFormat(fmt="nvfp4", rht_signs=SIGNS, stochastic=True)
    fb = BlockFormat(fmt="nvfp4", rht_signs=SIGNS)
    gw = blockscaled_mm(dy.t(), x, a_format=fa, b_format=fb, a_noise=torch.tensor([3]))
    exact = dy.double().t() @ x.double()
    assert ((gw.double() - exact).norm() / exact.norm()).item() < 0.3
    with pytest.raises(ValueError, match="rotate both operands"):
        blockscaled_mm(dy.t(), x, a_format=fa, b_format=BlockFormat(fmt="nvfp4"),
                       a_noise=torch.tensor([3]))
    with pytest.raises(ValueError, match="needs noise"):
        blockscaled_mm(dy.t(), x, a_format=fa, b_format=fb)


def test_shapes_a_recipe_cannot_take_are_named_not_padded():
    assert block_refusal("mxfp8", (8, 64), -1) is None
    assert block_refusal("mxfp8", (8, 40), 1) == (
        "K=40 (dim 1) is not a multiple of mxfp8's block of 32")
    assert block_refusal("nvfp4", (40, 32), 1, tile_dim=0) == (
        "tile dim=40 (dim 0) is not a multiple of nvfp4's block of 16")
    assert linear_refusal("mxfp8", 64, 64, 64) is None
    assert linear_refusal("mxfp8", 48, 64, 64) == (
        "the grad_weight GEMM reduces over M=48, not a multiple of mxfp8's block of 32")
    assert linear_refusal("nvfp4", 48, 64, 64) is None
    assert "multiples of 128" in linear_refusal("nvfp4", 48, 64, 64, hardware=True)
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        mx_quantize(torch.ones(4, 48))
    with pytest.raises(ValueError, match="operand a of shape"):
        blockscaled_mm(torch.ones(4, 48), torch.ones(48, 16), a_format=BlockFormat(),
                       b_format=BlockFormat())
    with pytest.raises(ValueError, match="apply to fmt='nvfp4'"):
        BlockFormat(fmt="mxfp8", tiles=True)
    with pytest.raises(ValueError, match="'rceil', 'floor', 'ceil', 'even'"):
        mx_quantize(torch.ones(4, 32), mode="round")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_recipes_are_registered(recipe):
    # wired into the float8 pass: tests/test_float8_blockscaled.py
    assert Float8Config(recipe=recipe).spec.block == recipe


# --- bit for bit with torchao (0.18) --------------------------------------------------------

@pytest.fixture(scope="module")
def ao():
    pytest.importorskip("torchao.prototype.mx_formats", reason="torchao is not installed")
    from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor
    return mx_tensor, nvfp4_tensor, kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("mode,dtype", list(itertools.product(
    MX_SCALE_MODES, [torch.float32, torch.bfloat16])))
@pytest.mark.parametrize("shape", [(4, 32), (64, 128), (2, 3, 64)])
def test_mx_quantize_and_dequantize_bitwise_with_torchao(ao, mode, dtype, shape):
    mx_tensor = ao[0]
    x = _awkward(torch.Size(shape[:-1]).numel(), shape[-1])
    if x.shape[1] > 70:
        x[3, 5], x[4, 33], x[5, 70] = float("inf"), -float("inf"), float("nan")
    x = x.reshape(shape).to(dtype)
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32,
                                  getattr(mx_tensor.ScaleCalculationMode, mode.upper()))
    q = mx_quantize(x, mode=mode)
    assert torch.equal(_bits(q.scale), _bits(scale)) and q.scale.dtype == scale.dtype
    assert torch.equal(_bits(q.data), _bits(data)) and q.data.dtype == data.dtype
    theirs = mx_tensor.to_dtype(data, scale, torch.float8_e4m3fn, 32, dtype)
    assert torch.equal(_bits(mx_dequantize(q, dtype)), _bits(theirs))


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_along_dim0_is_torchaos_dim1_cast(ao, mode):
    # torchao's training linear casts grad_weight's operands along dim 0 as to_mx of the
    # transpose (triton_to_mxfp8_dim1_reference); so does dim=0 here.
    mx_tensor = ao[0]
    x = _awkward(64, 96).bfloat16()
    scale, data = mx_tensor.to_mx(x.t().contiguous(), torch.float8_e4m3fn, 32,
                                  getattr(mx_tensor.ScaleCalculationMode, mode.upper()))
    q = mx_quantize(x, dim=0, mode=mode)
    assert torch.equal(_bits(q.data), _bits(data.t())) and torch.equal(_bits(q.scale),
                                                                      _bits(scale.t()))


def _nvfp4_inputs():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-3, 3, 64)
    x[0, :16] = 0
    x[1, :16] *= 1e-30
    specials = {"spread": x, "large": x * 1e30, "denormal": x * 1e-40, "zeros": x * 0}
    for name, value in (("inf", float("inf")), ("nan", float("nan"))):
        specials[name] = x.clone()
        specials[name][3, 4] = value
    return specials


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_nvfp4_inputs()))
def test_nvfp4_emulated_rule_bitwise_with_torchao(ao, dtype, case):
    nvfp4_tensor = ao[1]
    x = _nvfp4_inputs()[case].to(dtype)
    tensor_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax())
    scale, data = nvfp4_tensor.nvfp4_quantize(x, 16, tensor_scale)
    q = nvfp4_quantize(x, rule="emulated")
    assert torch.equal(_bits(q.scale), _bits(scale)) and torch.equal(_bits(q.tensor_scale),
                                                                      _bits(tensor_scale))
    assert torch.equal(q.data, data)  # nan's codes too (Note [e2m1 codes of nan])
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale)
    assert torch.equal(_bits(nvfp4_dequantize(q, dtype)), _bits(theirs.dequantize(dtype)))


def test_e2m1_and_packing_bitwise_with_torchao(ao):
    kernels = ao[2]
    x = torch.cat([torch.linspace(-6, 6, 100001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5,
                                                                  3.5, 5.0, -0.0, 1e-30])])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x400000], dtype=torch.int32)
    x = torch.cat([x, nans.view(torch.float32)])  # quiet, signalling, all ones, negative
    assert torch.equal(e2m1_encode(x), kernels.f32_to_f4_unpacked(x))
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_decode(codes), kernels.f4_unpacked_to_f32(codes))
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    assert torch.equal(pack_e2m1(codes), kernels.pack_uint4(codes))
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)),
                       kernels.unpack_uint4(kernels.pack_uint4(codes)))


def test_hadamard_matrix_is_torchaos(ao):
    pytest.importorskip("torchao.prototype.moe_training.nvfp4_training.hadamard_utils")
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix
    theirs = get_rht_matrix(SIGNS, "cpu", torch.bfloat16, 16)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(12)).bfloat16()
    expected = (x.float().reshape(4, 4, 16) @ theirs.float()).reshape(4, 64).bfloat16()
    assert torch.equal(hadamard_transform(x, SIGNS), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_gemm_matches_torchaos_emulated_mm(ao, dtype):
    # torchao's emulated MX GEMM dequantizes to the input dtype (exact: the scales are powers of
    # two) and multiplies there; on this CPU's kernels that is the float32 product rounded once.
    mx_tensor = ao[0]
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    g = torch.Generator().manual_seed(13)
    a, w = torch.randn(64, 128, generator=g).to(dtype), torch.randn(96, 128, generator=g).to(dtype)

    def mx(t):
        return mx_tensor.MXTensor.to_mx(t, torch.float8_e4m3fn, 32,
                                        mx_tensor.ScaleCalculationMode.RCEIL,
                                        KernelPreference.EMULATED)

    theirs = torch.mm(mx(a), mx(w).t())
    fmt = BlockFormat()
    assert torch.equal(blockscaled_mm(a, w.t(), a_format=fmt, b_format=fmt), theirs)


def test_nvfp4_gemm_matches_torchaos_emulated_mm_in_float32(ao):
    # In bfloat16 torchao rounds each dequantized operand to bfloat16 before its GEMM; fxamp
    # keeps them in float32 (docs/float8.md, "Block-scaled formats").
    nvfp4_tensor = ao[1]
    g = torch.Generator().manual_seed(14)
    a, w = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g)

    def nv(t):
        return nvfp4_tensor.NVFP4Tensor.to_nvfp4(
            t, per_tensor_scale=nvfp4_tensor.per_tensor_amax_to_scale(t.abs().amax()))

    fmt = BlockFormat(fmt="nvfp4", rule="emulated")
    assert torch.equal(blockscaled_mm(a, w.t(), a_format=fmt, b_format=fmt),
                       torch.mm(nv(a), nv(w).t()))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_batched_gemms_entries_are_separate_gemms(fmt):
    # each entry of a batched GEMM quantizes as the 2-D GEMM of that entry would: NVFP4's
    # per-tensor scale is per entry, so an entry of large values leaves the others' alone
    from fxamp.float8.block_gemm import block_formats, block_mm

    g = torch.Generator().manual_seed(11)
    a = torch.randn(3, 32, 64, generator=g).bfloat16()
    b = (torch.randn(3, 64, 48, generator=g) * torch.tensor([1.0, 1e4, 1e-3])[:, None, None])
    act, weight = block_formats(fmt)
    got = block_mm(a, b.bfloat16(), act, weight, torch.float32)
    for i in range(3):
        assert torch.equal(got[i], block_mm(a[i], b[i].bfloat16(), act, weight, torch.float32))


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (100, 3), (1, 1), (130, 9)])
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32])
def test_swizzled_scales_are_cublas_layout_as_torchao_lays_it_out(shape, dtype):
    # cuBLAS's block-scaling-factor layout (the hardware lowering's input), whole tiles and
    # padded ones, e8m0 (MXFP8), e4m3 (NVFP4) and plain values
    torch.manual_seed(0)
    raw = torch.randint(0, 255, shape, dtype=torch.uint8)
    scale = raw.view(dtype) if dtype.itemsize == 1 else raw.to(dtype)
    mine = swizzle_block_scales(scale)
    assert mine.dtype == dtype and mine.numel() == -(-shape[0] // 128) * 128 * -(-shape[1] // 4) * 4
    # tile (0, 0): row 32 * i + j, column c at 16 * j + 4 * i + c
    as_bytes = mine.view(torch.uint8) if dtype.itemsize == 1 else mine
    src = raw if dtype.itemsize == 1 else scale
    for r, c in [(0, 0), (min(shape[0], 128) - 1, min(shape[1], 4) - 1), (shape[0] // 2, 0)]:
        i, j = divmod(r, 32)
        if r < 128 and c < 4:
            assert as_bytes[16 * j + 4 * i + c] == src[r, c]
    to_blocked = _torchao_to_blocked()
    if to_blocked is not None:
        ref = to_blocked(scale.view(torch.uint8) if dtype.itemsize == 1 else scale)
        assert torch.equal(as_bytes, ref)


def _torchao_to_blocked():
    try:
        from torchao.prototype.mx_formats.utils import to_blocked
    except ImportError:
        return None
    return to_blocked


def test_swizzle_refuses_other_than_a_matrix():
    with pytest.raises(ValueError, match=r"block scales are \[rows, K // block\], not of shape "
                       r"\(2, 3, 4\)"):
        swizzle_block_scales(torch.zeros(2, 3, 4))
