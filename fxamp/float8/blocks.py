"""Block layouts of the block-scaled formats: a tensor cut into blocks along one dim, and back.

Every block-scaled quantizer (fxamp/float8/mxfp8.py, nvfp4.py) works on a float32 view
[..., K // block, block] of its input with the reduction dim moved last; `Blocks` remembers how
to put the result back. `block_refusal` says why a shape cannot be blocked (never padded).
`swizzle_block_scales` lays a GEMM operand's scales out as cuBLAS's block-scaled GEMMs read them
(the hardware lowering's input, compute capability 10.0+; not yet wired into the pass).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["MX_BLOCK", "NVFP4_BLOCK", "Blocks", "block_refusal", "swizzle_block_scales",
           "to_blocks"]

MX_BLOCK = 32  # OCP MX v1.0: one e8m0 scale per 32 elements
NVFP4_BLOCK = 16  # NVFP4: one e4m3 scale per 16 elements (and 16x16 tiles for 2-D blocks)
FORMATS = {"mxfp8": MX_BLOCK, "nvfp4": NVFP4_BLOCK}


class Blocks(NamedTuple):
    """`x` as float32 blocks along `dim`: `data` is [..., K // block, block] (dim moved last)."""

    data: torch.Tensor
    dim: int

    def restore(self, blocked: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like `data` (or like `data` with its last dim squeezed, for scales)
        back in the input's layout: the blocked dim where it was."""
        moved = blocked.reshape(*self.data.shape[:-2], -1)
        return moved.movedim(-1, self.dim)


def to_blocks(x: torch.Tensor, dim: int, block: int) -> Blocks:
    """`x` in float32, `dim` moved last and cut into blocks of `block` (exactly: a float16,
    bfloat16 or float32 x converts without rounding; float64 is rounded to float32 first)."""
    dim = dim % x.dim()
    if x.shape[dim] % block:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} is not a multiple of "
                         f"the block size {block} (block_refusal says so before quantizing)")
    moved = x.to(torch.float32).movedim(dim, -1).contiguous()
    return Blocks(moved.reshape(*moved.shape[:-1], moved.shape[-1] // block, block), dim)


def block_refusal(fmt: str, shape: Sequence[int], dim: int, *,
                  tile_dim: Optional[int] = None) -> Optional[str]:
    """Why a tensor of `shape` cannot be quantized to `fmt` along `dim` (its GEMM's reduction
    dim), or None when it can.

    Args:
        fmt: "mxfp8" (blocks of 32) or "nvfp4" (blocks of 16).
        shape: the high-precision tensor's shape.
        dim: the reduction dim, cut into blocks.
        tile_dim: for NVFP4's 16x16 weight blocks, the other dim of the tile.

    Returns:
        A sentence naming the dim and the rule ("K=40 (dim 1) is not a multiple of mxfp8's block
        of 32"), or None. Nothing is ever padded: the caller keeps such a GEMM in high precision.
    """
    if fmt not in FORMATS:
        raise ValueError(f"block-scaled format {fmt!r} is not one of "
                         f"{', '.join(map(repr, FORMATS))}")
    block, rank = FORMATS[fmt], len(shape)
    if rank == 0:
        return f"{fmt} needs a tensor with a reduction dim, not a scalar"
    dims = [("K", dim)] + ([] if tile_dim is None else [("tile dim", tile_dim)])
    for name, d in dims:
        if not -rank <= d < rank:
            return f"dim {d} is out of range for a tensor of shape {tuple(shape)}"
        if shape[d] % block:
            return (f"{name}={shape[d]} (dim {d % rank}) is not a multiple of {fmt}'s block of "
                    f"{block}")
    if fmt == "nvfp4" and tile_dim is not None and (dim - tile_dim) % rank == 0:
        return "nvfp4's 16x16 blocks need two different dims"
    return None


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """A GEMM operand's block scales, [rows, K // block] (rows: M of the left operand, N of the
    right), in the layout cuBLAS's block-scaled GEMMs read (its "block scaling factors
    layout", the one torchao's `to_blocked` produces): zero-padded to whole tiles of 128 rows x
    4 scales, the tiles in row-major order, and inside a tile the scale of row 32 * i + j,
    column c at 16 * j + 4 * i + c. Returns the 1-D result, in `scale`'s dtype (the bytes are
    moved as they are: an e8m0 pad is the byte 0)."""
    if scale.dim() != 2:
        raise ValueError(f"block scales are [rows, K // block], not of shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    raw = scale.view(torch.uint8) if scale.dtype.itemsize == 1 else scale
    padded = raw.new_zeros(tiles_r * 128, tiles_c * 4)
    padded[:rows, :cols] = raw
    # (row tile, i, j, column tile, c) -> (row tile, column tile, j, i, c)
    out = padded.reshape(tiles_r, 4, 32, tiles_c, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return out.view(scale.dtype) if raw is not scale else out

