"""NVFP4: e2m1 values, one e4m3 scale per block of 16 and one float32 scale per tensor.

Two ways of computing the scales, both torchao 0.18's (Note [NVFP4 scale rules]); options for
16x16 weight blocks, stochastic rounding from an explicit generator or seed, and the random
Hadamard transform torchao's training recipe applies to the grad_weight GEMM's operands.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

from fxamp.float8.blocks import NVFP4_BLOCK, to_blocks

__all__ = ["NVFP4_RHT_SIGNS", "NVFP4_RULES", "NVFP4Quantized", "e2m1_decode", "e2m1_encode", "hadamard_transform",
           "nvfp4_dequantize", "nvfp4_quantize", "pack_e2m1", "unpack_e2m1"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
E4M3_TINY = torch.finfo(E4M3).tiny  # 2**-6, the floor on a block scale
E2M1_MAX = 6.0
F32_MAX = torch.finfo(torch.float32).max
# The magnitudes of e2m1's codes 0..7, and the points between them where round-to-nearest-even
# moves up a code: ">" where the tie goes down to an even code, ">=" where it goes up to one.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
           (5.0, False))

# Note [NVFP4 scale rules]
# amax is the tensor's, s_b = amax_block / 6 the ideal block scale, and the per-tensor scale
# torchao hands the GEMM is always amax / (448 * 6).
#   "kernel": the training recipe's Triton kernels (torchao.prototype.moe_training
#     .nvfp4_training, `_nvfp4_quantize` and `_nvfp4_2d_quantize`): block scale
#     e4m3(clamp(s_b * g, 2**-6, 448)) with g = min(448 * 6 / amax, f32 max) (1 for amax 0),
#     values x * min(1 / (block scale * (1 / g)), f32 max), saturated to 6. GPU-only in
#     torchao, so re-derived here from the kernel source, not compared bit for bit.
#   "emulated": torchao's eager `nvfp4_quantize(x, 16, per_tensor_scale)` (NVFP4Tensor, the
#     path that runs on CPU): block scale e4m3(clamp(s_b / t, 2**-6, 448)) with t the per-tensor
#     scale, values x * ((1 / t) / block scale). Bit for bit with torchao; an all-zero tensor
#     makes t 0 and every scale nan, as in torchao.
# The two differ by the rounding of g against 1 / t: rarely by one e4m3 step of a scale.
NVFP4_RULES = ("kernel", "emulated")
# A fixed sign vector for the Hadamard transform (Float8Config.nvfp4_rht_signs): drawn once,
# from a seeded generator; any vector of +1/-1 rotates orthogonally.
NVFP4_RHT_SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1)


class NVFP4Quantized(NamedTuple):
    """An NVFP4 tensor: `data` (uint8, two e2m1 codes a byte along `dim`, the first in the low
    nibble, as torchao's `pack_uint4`), `scale` (float8_e4m3fn, one per block of 16 along `dim`),
    `tensor_scale` (float32 scalar: dequantized = e2m1 * scale * tensor_scale), the blocked
    `dim`."""

    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor
    dim: int


def e2m1_encode(x: torch.Tensor, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 `x` (already within +-6) to e2m1 codes in uint8 (sign in bit 3), to nearest even,
    or rounded up with probability equal to the distance from the code below when `noise`
    (uniform in [0, 1), x's shape) is given. e2m1 has no nan: a nan gets the code torchao's
    conversion gives it (Note [e2m1 codes of nan])."""
    mag = x.abs()
    code = torch.zeros_like(x, dtype=torch.uint8)
    if noise is None:
        for point, tie_up in E2M1_UP:
            code += (mag >= point if tie_up else mag > point).to(torch.uint8)
    else:
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=x.device)
        below = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 6)
        low = grid[below]
        step = grid[below + 1] - low
        code = (below + (noise * step < mag - low).to(below.dtype)).to(torch.uint8)
    code = torch.where(torch.isnan(x), _nan_code(x), code)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


# Note [e2m1 codes of nan]
# torchao's float32 -> e2m1 conversion (`f32_to_f4_unpacked`) rounds by integer arithmetic on
# the float32 bits and has no case for nan, which takes the normal-number path: its bits plus
# the rounding bias, shifted down to 3 bits and truncated to a byte, give magnitude code 2, 3
# or 4 (1.0, 1.5 or 2.0), with the nan's sign bit. It matters where a finite block meets an
# infinite reciprocal (a per-tensor scale in float32's denormals makes 0 * inf): torchao
# returns those codes, and bit-for-bit equality means returning them too.
def _nan_code(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32) & 0x7FFFFFFF
    biased = bits + ((1 - 127) << 23) + (1 << 21) - 1 + ((bits >> 22) & 1)
    return (biased >> 22).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3) to float32."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) > 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte along the last dim: element 2i in the low nibble, 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def hadamard_transform(x: torch.Tensor, signs: Sequence[int], *, dim: int = -1) -> torch.Tensor:
    """The random Hadamard transform of torchao's NVFP4 training recipe: each block of 16 along
    `dim` times diag(signs) @ H16 / 4 (H16 the Sylvester Hadamard matrix), in float32, the result
    in x's dtype (the Triton kernel casts its product to bfloat16). Orthogonal, so applied to both
    operands along their shared reduction dim it leaves the exact product unchanged."""
    if len(signs) != NVFP4_BLOCK or any(s not in (1, -1) for s in signs):
        raise ValueError(f"signs={tuple(signs)!r} must be 16 entries of +1 or -1")
    blocks = to_blocks(x, dim, NVFP4_BLOCK)
    index = torch.arange(NVFP4_BLOCK)
    parity = torch.bitwise_and(index[:, None], index[None, :])
    parity = sum((parity >> b) & 1 for b in range(4)) % 2  # H16[i, j] = (-1)**popcount(i & j)
    h16 = (1 - 2 * parity).to(torch.float32) / math.sqrt(NVFP4_BLOCK)
    rotation = torch.tensor(signs, dtype=torch.float32)[:, None] * h16
    return blocks.restore(blocks.data @ rotation.to(x.device)).to(x.dtype)


def nvfp4_quantize(x: torch.Tensor, *, dim: int = -1, tile_dim: Optional[int] = None,
                   rule: str = "kernel", amax: Optional[torch.Tensor] = None,
                   stochastic: Union[None, torch.Generator, torch.Tensor] = None,
                   batch_dims: int = 0) -> NVFP4Quantized:
    """Quantize `x` to NVFP4 along `dim` (its GEMM's reduction dim), in blocks of 16.

    Args:
        x: float32 or bfloat16; `x.shape[dim]` a multiple of 16 (`block_refusal`).
        dim: the dim cut into blocks (and packed two codes a byte).
        tile_dim: give the other dim to share one scale over 16x16 tiles (torchao's 2-D weight
            blocks: the weight and its transpose quantize to the same values). A multiple of 16.
        rule: "kernel" or "emulated" (Note [NVFP4 scale rules]).
        amax: the tensor's amax, if already known (after an all-reduce, say); else x's.
        stochastic: None rounds to nearest even; a torch.Generator draws the rounding noise from
            it (torch.rand); an int64 seed tensor hashes (seed, element index) into the noise,
            with no RNG state at all. Either way nothing global is read or advanced.
        batch_dims: how many leading dims index separate tensors (the entries of a batched
            GEMM: one per-tensor scale each, `tensor_scale` then shaped [*batch, 1, ...]).

    Returns:
        `NVFP4Quantized`. With rule="emulated", dim=-1 and x 2-D, scale and data equal torchao's
        `nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))` bit for bit.
    """
    if rule not in NVFP4_RULES:
        raise ValueError(f"NVFP4 rule {rule!r} is not one of {', '.join(map(repr, NVFP4_RULES))}")
    blocks = to_blocks(x, dim, NVFP4_BLOCK)
    data = blocks.data
    if amax is None:  # per tensor, or per entry of the leading `batch_dims`
        amax = data.abs().amax(dim=tuple(range(batch_dims, data.dim())), keepdim=True)
        amax = amax.reshape(amax.shape[:batch_dims] + (1,) * (data.dim() - batch_dims))
    amax = amax.to(torch.float32)
    block_amax = data.abs().amax(dim=-1, keepdim=True)
    if tile_dim is not None:
        block_amax = _tile_amax(block_amax, _moved_index(tile_dim % x.dim(), blocks.dim))
    tensor_scale = amax / (E4M3_MAX * E2M1_MAX)
    if rule == "kernel":
        encode = torch.where(amax == 0, 1.0, torch.clamp(E4M3_MAX * E2M1_MAX / amax, max=F32_MAX))
        encode = torch.where(encode == 0, 1.0, encode)
        scale = torch.clamp(block_amax / E2M1_MAX * encode, E4M3_TINY, E4M3_MAX).to(E4M3)
        inverse = torch.clamp(1.0 / (scale.to(torch.float32) * (1.0 / encode)), max=F32_MAX)
    else:
        scale = torch.clamp(block_amax / E2M1_MAX / tensor_scale, E4M3_TINY, E4M3_MAX).to(E4M3)
        inverse = (1.0 / tensor_scale) / scale.to(torch.float32)
    scaled = torch.clamp(data * inverse, -E2M1_MAX, E2M1_MAX)
    codes = e2m1_encode(scaled, _noise(stochastic, scaled))
    packed = pack_e2m1(codes.flatten(-2)).movedim(-1, blocks.dim)
    # the tensor scale broadcasts against the input's layout ([*batch, 1, ...]; 0-dim unbatched)
    tensor_scale = tensor_scale.reshape(tensor_scale.shape[:batch_dims]
                                        + (1,) * (x.dim() - batch_dims) if batch_dims else ())
    return NVFP4Quantized(packed, blocks.restore(scale), tensor_scale, blocks.dim)


def _moved_index(tile_dim: int, dim: int) -> int:
    # Where `tile_dim` sits once `dim` has been moved last.
    if tile_dim == dim:
        raise ValueError(f"tile_dim={tile_dim} must differ from dim={dim}: a 16x16 tile spans two")
    return tile_dim - (tile_dim > dim)


def _tile_amax(block_amax: torch.Tensor, moved_dim: int) -> torch.Tensor:
    # block_amax is [..., K // 16, 1] with the reduction dim moved last; `moved_dim` is the tile
    # dim's index there. Take the max over its groups of 16 and broadcast it back.
    amax = block_amax.movedim(moved_dim, 0)
    if amax.shape[0] % NVFP4_BLOCK:
        raise ValueError(f"the tile dim has size {amax.shape[0]}, not a multiple of 16")
    tiles = amax.reshape(amax.shape[0] // NVFP4_BLOCK, NVFP4_BLOCK, *amax.shape[1:])
    tiles = tiles.amax(dim=1, keepdim=True).expand_as(tiles)
    return tiles.reshape(amax.shape).movedim(0, moved_dim)


def _noise(stochastic: Union[None, torch.Generator, torch.Tensor],
           like: torch.Tensor) -> Optional[torch.Tensor]:
    if stochastic is None:
        return None
    if isinstance(stochastic, torch.Generator):
        return torch.rand(like.shape, generator=stochastic, device=like.device)
    if not (isinstance(stochastic, torch.Tensor) and stochastic.numel() == 1
            and stochastic.dtype == torch.int64):
        raise ValueError(f"stochastic={stochastic!r} must be None, a torch.Generator or an int64 "
                         "seed tensor of one element")
    index = torch.arange(like.numel(), device=like.device, dtype=torch.int64).view(like.shape)
    return _uniform_hash(index, stochastic.reshape(()))


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (xor-shift-multiply) in int64: constants below 2**31, so the
    # products never overflow.
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & mask
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & mask
    return h ^ (h >> 16)


def _uniform_hash(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    key = _mix32(seed & mask) ^ _mix32((seed >> 32) & mask)
    h = _mix32((index & mask) ^ key)
    return (h >> 8).to(torch.float32) * 2.0 ** -24  # 24 bits: exact in float32, below 1


def nvfp4_dequantize(q: NVFP4Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q` back in `dtype`: e2m1 value * (tensor_scale * block scale) in float32, then `dtype`
    (torchao's `NVFP4Tensor.dequantize`, bit for bit)."""
    codes = unpack_e2m1(q.data.movedim(q.dim, -1))
    values = e2m1_decode(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    scale = (q.tensor_scale * q.scale.movedim(q.dim, -1).to(torch.float32)).unsqueeze(-1)
    return (values * scale).reshape(codes.shape).to(dtype).movedim(-1, q.dim)
