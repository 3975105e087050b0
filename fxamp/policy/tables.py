"""Op policy as data: which ATen overloads run in the low dtype, in fp32, or promoted.

Three presets, each a frozen mapping from `OpOverload` to a cast policy:

- ``"torch-cuda"`` and ``"torch-cpu"`` reproduce `torch.autocast`'s CUDA and CPU tables op for op
  (aten/src/ATen/autocast_mode.{h,cpp} of torch 2.x, the level autocast itself dispatches at);
- ``"apex"`` maps Apex amp's torch-function lists (fp16 / fp32 / promote / banned) onto the
  same ATen overloads.

Names that this torch build does not have are left out of its tables, so a preset never fails
to load, and listed by `unresolved_names` (tests/test_policy.py lists them per supported torch
build, so that a misspelt name fails a test instead of disappearing). The precedence between
tables and overrides is in rules.py.
"""

from __future__ import annotations

import types
from typing import Mapping

import torch

from fxamp._compat import OpOverload
from fxamp.policy.vocabulary import CastPolicy

__all__ = ["PRESETS", "preset_table", "unresolved_names", "resolve_op_name",
           "BANNED_ALTERNATIVES", "ONE_DTYPE_OPS", "RECURRENT_FUNCTIONS"]


BANNED_ALTERNATIVES = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy / nn.BCELoss is unsafe in low precision: "
        "fuse the preceding sigmoid into torch.nn.functional.binary_cross_entropy_with_logits "
        "(nn.BCEWithLogitsLoss), which fxamp runs in fp32, or override the op with "
        "op_overrides={'aten.binary_cross_entropy': 'fp32'}"
    ),
}

# --- torch.autocast, CUDA (AT_FORALL_* in autocast_mode.h) -----------------------------------
_TORCH_CUDA_LOWER = """
_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention
cudnn_convolution cudnn_convolution_transpose
"""
_TORCH_CUDA_FP32 = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm rms_norm
frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
_upsample_bicubic2d_aa
norm.Scalar norm.ScalarOpt_dim norm.names_ScalarOpt_dim
"""
# norm.* above are autocast's fp32_append_dtype ops: computing them in fp32 gives the same dtype.
_TORCH_FP32_SET_OPT_DTYPE = """
prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int
log_softmax.Dimname cumprod cumprod.dimname cumsum cumsum.dimname linalg_vector_norm
linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList sum.dim_DimnameList
"""
_TORCH_CUDA_PROMOTE = """
addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add
"""

# --- torch.autocast, CPU (TORCH_LIBRARY_IMPL(aten, AutocastCPU) in autocast_mode.cpp) ----------
_TORCH_CPU_LOWER = """
conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm
addmm _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer
conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention
_native_multi_head_attention
"""
# RNN cells are composite ops: CPU autocast has no entry for them and reaches the linear layers
# inside through their decomposition (bf16), while fxamp's graph keeps the cell as one node,
# which meets a 16-bit input and fp32 weights. They run in the low dtype, as in CUDA autocast's
# list and Apex's (conformance pattern rnn_cell).
_TORCH_CPU_LOWER_CELLS = "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell"
# The fused encoder layer nn.TransformerEncoderLayer calls in eval() under no_grad: CPU autocast
# leaves its fast path on (the module only checks CUDA's autocast) and has no entry for it,
# but reaches the matmuls its kernel calls, so it runs in the low dtype with the residual
# stream 16-bit. Lowering its inputs gives that within one rounding of the input and the norm
# weights (conformance pattern transformer_encoder_eval). CUDA autocast turns the fast path off.
_TORCH_CPU_LOWER_FUSED = "_transformer_encoder_layer_fwd"
_TORCH_CPU_FP32 = """
avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int prod.dim_Dimname quantile
quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d
_grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky cholesky_inverse
cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d
adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss
soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2
fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft
linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor
linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float linalg_solve
linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
linalg_householder_product linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine
geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd
linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
"""
_TORCH_CPU_PROMOTE = "stack cat index_copy index_copy.dimname"

# --- Apex amp's lists (apex.amp.lists: functional_, torch_ and tensor_overrides) -------------
_APEX_LOWER = """
conv1d conv2d conv3d conv_transpose1d conv_transpose2d.input conv_transpose3d.input conv_tbc
convolution _convolution prelu linear addmm addmv addr matmul mm mv bmm addbmm baddbmm lstm_cell
gru_cell rnn_tanh_cell rnn_relu_cell
"""
_APEX_FP32 = """
softmax.int log_softmax.int softplus gelu layer_norm group_norm cosine_similarity
upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d
upsample_trilinear3d upsample_bicubic2d grid_sampler cross_entropy_loss nll_loss nll_loss2d
mse_loss l1_loss smooth_l1_loss huber_loss kl_div binary_cross_entropy_with_logits ctc_loss.IntList
ctc_loss.Tensor margin_ranking_loss hinge_embedding_loss multilabel_margin_loss soft_margin_loss
multi_margin_loss triplet_margin_loss cosine_embedding_loss poisson_nll_loss acos asin cosh erfinv
exp expm1 log log10 log2 reciprocal rsqrt sinh tan pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar
cumprod cumsum dist norm.Scalar norm.ScalarOpt_dim linalg_vector_norm prod prod.dim_int sum
sum.dim_IntList std std.dim std.correction var var.dim var.correction renorm
"""
_APEX_PROMOTE = """
addcdiv addcmul atan2 cross bilinear dot add.Tensor sub.Tensor div.Tensor mul.Tensor eq.Tensor
ne.Tensor lt.Tensor le.Tensor gt.Tensor ge.Tensor cat stack
"""
_BANNED = "binary_cross_entropy"

# Whole recurrent layers, by torch function (what nn.RNN/GRU/LSTM call, packed sequences too).
# Dynamo runs these modules eagerly, outside fxamp's graphs, so at O1 their input, hidden state
# and weights are cast to the low dtype by a function mode instead (eager_regions.py), as Apex
# did for every recurrent layer (Apex's `amp.rnn_compat`).
RECURRENT_FUNCTIONS = "lstm gru rnn_tanh rnn_relu"


def resolve_op_name(name: str) -> OpOverload | None:
    """'softmax.int' -> aten.softmax.int, 'mm' -> aten.mm.default; None if this build lacks it."""
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    op = getattr(packet, overload or "default", None) if packet is not None else None
    return op if isinstance(op, OpOverload) else None


# The lists of each preset, by the policy they give.
_LISTS: Mapping[str, Mapping[str, str]] = types.MappingProxyType({
    "torch-cuda": dict(lower=_TORCH_CUDA_LOWER, fp32=_TORCH_CUDA_FP32,
                       fp32_set_opt_dtype=_TORCH_FP32_SET_OPT_DTYPE, promote=_TORCH_CUDA_PROMOTE,
                       banned=_BANNED),
    "torch-cpu": dict(lower=" ".join((_TORCH_CPU_LOWER, _TORCH_CPU_LOWER_CELLS,
                                      _TORCH_CPU_LOWER_FUSED)), fp32=_TORCH_CPU_FP32,
                      promote=_TORCH_CPU_PROMOTE),
    "apex": dict(lower=_APEX_LOWER, fp32=_APEX_FP32, promote=_APEX_PROMOTE, banned=_BANNED),
})


def _table(lists: Mapping[str, str]) -> Mapping[OpOverload, CastPolicy]:
    table: dict[OpOverload, CastPolicy] = {}
    for policy_name, names in lists.items():
        for op in filter(None, map(resolve_op_name, names.split())):
            table[op] = CastPolicy(policy_name)
    return types.MappingProxyType(table)


PRESETS: Mapping[str, Mapping[OpOverload, CastPolicy]] = types.MappingProxyType(
    {name: _table(lists) for name, lists in _LISTS.items()})

# Ops whose kernels take one floating dtype (matmuls, convolutions, attention): the ops
# torch.autocast lowers on CUDA. A policy that hands them mixed dtypes cannot run, so validate
# refuses it, and at O2/O3 an fp32 value meeting low-precision ones there is cast (annotate).
ONE_DTYPE_OPS = frozenset(op for op in map(resolve_op_name, _TORCH_CUDA_LOWER.split()) if op)


def preset_table(name: str) -> Mapping[OpOverload, CastPolicy]:
    return PRESETS[name]


def unresolved_names(preset: str) -> tuple[str, ...]:
    """The names in `preset`'s lists that this torch build has no ATen overload for."""
    names = {n for names in _LISTS[preset].values() for n in names.split()}
    return tuple(sorted(n for n in names if resolve_op_name(n) is None))
