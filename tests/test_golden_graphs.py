"""Golden forward and backward graphs, with a dtype on every value, at O1 and O2 (bf16, CPU).

Regenerate after an intended change with `EXPECTTEST_ACCEPT=1 python -m pytest <this file>`
and read the diff: every `# fxamp` line is a cast the passes inserted.
"""

import pytest

expecttest = pytest.importorskip("expecttest")  # golden graphs: not on the GPU machines

import fxamp
from examples import models
from fxamp.testing import format_graph


def _graphs(factory, opt_level):
    model, inputs = factory()
    report = fxamp.explain(model, *inputs, opt_level=opt_level, backward=True)
    assert len(report.graphs) == 1 and len(report.backward_graphs) == 1
    return (format_graph(report.graphs[0].graph_module),
            format_graph(report.backward_graphs[0], marks=False))


class TestGoldenGraphs(expecttest.TestCase):
    def test_mlp_o1(self):
        fw, bw = _graphs(models.mlp, "O1")
        self.assertExpectedInline(fw, """\
fc1_weight: f32[32,16]
fc1_bias: f32[32]
args_0: f32[8,16]
fc2_weight: f32[4,32]
fc2_bias: f32[4]
args_0_bf16: bf16[8,16] = _to_copy(args_0, dtype=bf16)  # fxamp
fc1_weight_bf16: bf16[32,16] = _to_copy(fc1_weight, dtype=bf16)  # fxamp
fc1_bias_bf16: bf16[32] = _to_copy(fc1_bias, dtype=bf16)  # fxamp
fc2_weight_bf16: bf16[4,32] = _to_copy(fc2_weight, dtype=bf16)  # fxamp
fc2_bias_bf16: bf16[4] = _to_copy(fc2_bias, dtype=bf16)  # fxamp
linear: bf16[8,32] = linear(args_0_bf16, fc1_weight_bf16, fc1_bias_bf16)
relu: bf16[8,32] = relu(linear)
linear_1: bf16[8,4] = linear(relu, fc2_weight_bf16, fc2_bias_bf16)
to: f32[8,4] = to.dtype(linear_1, f32)  # fxamp boundary
return [to]""")
        self.assertExpectedInline(bw, """\
_to_copy: bf16[8,16]
relu: bf16[8,32]
detach: bf16[8,32]
t_1: bf16[32,4]
tangents_1: f32[8,4]
_to_copy_6: bf16[8,4] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
t_2: bf16[4,32] = t(t_1)
mm: bf16[8,32] = mm(_to_copy_6, t_2)
t_3: bf16[4,8] = t(_to_copy_6)
mm_1: bf16[4,32] = mm(t_3, relu)
t_4: bf16[32,4] = t(mm_1)
sum_1: bf16[1,4] = sum.dim_IntList(_to_copy_6, [0], True)
view: bf16[4] = view(sum_1, [4])
t_5: bf16[4,32] = t(t_4)
detach_1: bf16[8,32] = detach(detach)
threshold_backward: bf16[8,32] = threshold_backward(mm, detach_1, 0)
t_6: bf16[32,8] = t(threshold_backward)
mm_2: bf16[32,16] = mm(t_6, _to_copy)
t_7: bf16[16,32] = t(mm_2)
sum_2: bf16[1,32] = sum.dim_IntList(threshold_backward, [0], True)
view_1: bf16[32] = view(sum_2, [32])
t_8: bf16[32,16] = t(t_7)
_to_copy_7: f32[4] = _to_copy(view, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_8: f32[4,32] = _to_copy(t_5, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_9: f32[32] = _to_copy(view_1, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_10: f32[32,16] = _to_copy(t_8, dtype=f32, layout=torch.strided, device=device(type='cpu'))
return [_to_copy_10, _to_copy_9, None, _to_copy_8, _to_copy_7]""")

    def test_mlp_o2(self):
        fw, bw = _graphs(models.mlp, "O2")
        self.assertExpectedInline(fw, """\
args_0: f32[8,16]
fc1_weight: bf16[32,16]
fc1_bias: bf16[32]
fc2_weight: bf16[4,32]
fc2_bias: bf16[4]
to: bf16[8,16] = to.dtype(args_0, bf16)  # fxamp boundary
linear: bf16[8,32] = linear(to, fc1_weight, fc1_bias)
relu: bf16[8,32] = relu(linear)
linear_1: bf16[8,4] = linear(relu, fc2_weight, fc2_bias)
to_1: f32[8,4] = to.dtype(linear_1, f32)  # fxamp boundary
return [to_1]""")
        self.assertExpectedInline(bw, """\
_to_copy: bf16[8,16]
relu: bf16[8,32]
detach: bf16[8,32]
t_1: bf16[32,4]
tangents_1: f32[8,4]
_to_copy_2: bf16[8,4] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
t_2: bf16[4,32] = t(t_1)
mm: bf16[8,32] = mm(_to_copy_2, t_2)
t_3: bf16[4,8] = t(_to_copy_2)
mm_1: bf16[4,32] = mm(t_3, relu)
t_4: bf16[32,4] = t(mm_1)
sum_1: bf16[1,4] = sum.dim_IntList(_to_copy_2, [0], True)
view: bf16[4] = view(sum_1, [4])
t_5: bf16[4,32] = t(t_4)
detach_1: bf16[8,32] = detach(detach)
threshold_backward: bf16[8,32] = threshold_backward(mm, detach_1, 0)
t_6: bf16[32,8] = t(threshold_backward)
mm_2: bf16[32,16] = mm(t_6, _to_copy)
t_7: bf16[16,32] = t(mm_2)
sum_2: bf16[1,32] = sum.dim_IntList(threshold_backward, [0], True)
view_1: bf16[32] = view(sum_2, [32])
t_8: bf16[32,16] = t(t_7)
return [None, t_8, view_1, t_5, view]""")

    def test_cnn_o1(self):
        fw, bw = _graphs(models.cnn, "O1")
        self.assertExpectedInline(fw, """\
conv_weight: f32[4,1,3,3]
conv_bias: f32[4]
args_0: f32[2,1,8,8]
bn_num_batches_tracked: i64[]
bn_running_mean: f32[4]
bn_running_var: f32[4]
bn_weight: f32[4]
bn_bias: f32[4]
fc_weight: f32[10,64]
fc_bias: f32[10]
args_0_bf16: bf16[2,1,8,8] = _to_copy(args_0, dtype=bf16)  # fxamp
conv_weight_bf16: bf16[4,1,3,3] = _to_copy(conv_weight, dtype=bf16)  # fxamp
conv_bias_bf16: bf16[4] = _to_copy(conv_bias, dtype=bf16)  # fxamp
fc_weight_bf16: bf16[10,64] = _to_copy(fc_weight, dtype=bf16)  # fxamp
fc_bias_bf16: bf16[10] = _to_copy(fc_bias, dtype=bf16)  # fxamp
conv2d: bf16[2,4,8,8] = conv2d(args_0_bf16, conv_weight_bf16, conv_bias_bf16, [1, 1], [1, 1])
add_: i64[] = add_.Tensor(bn_num_batches_tracked, 1)
batch_norm: bf16[2,4,8,8] = batch_norm(conv2d, bn_weight, bn_bias, bn_running_mean, bn_running_var, True, 0.1, 1e-05, True)
relu: bf16[2,4,8,8] = relu(batch_norm)
max_pool2d: bf16[2,4,4,4] = max_pool2d(relu, [2, 2], [2, 2])
flatten: bf16[2,64] = flatten.using_ints(max_pool2d, 1)
linear: bf16[2,10] = linear(flatten, fc_weight_bf16, fc_bias_bf16)
to: f32[2,10] = to.dtype(linear, f32)  # fxamp boundary
return [to]""")
        self.assertExpectedInline(bw, """\
primals_7: f32[4]
_to_copy: bf16[2,1,8,8]
_to_copy_1: bf16[4,1,3,3]
convolution: bf16[2,4,8,8]
getitem_1: bf16[4]
getitem_2: bf16[4]
getitem_3: f32[4]
getitem_4: f32[4]
relu: bf16[2,4,8,8]
detach: bf16[2,4,8,8]
getitem_6: i64[2,4,4,4]
view: bf16[2,64]
t: bf16[64,10]
tangents_1: f32[2,10]
_to_copy_6: bf16[2,10] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
t_1: bf16[10,64] = t(t)
mm: bf16[2,64] = mm(_to_copy_6, t_1)
t_2: bf16[10,2] = t(_to_copy_6)
mm_1: bf16[10,64] = mm(t_2, view)
t_3: bf16[64,10] = t(mm_1)
sum_1: bf16[1,10] = sum.dim_IntList(_to_copy_6, [0], True)
view_1: bf16[10] = view(sum_1, [10])
t_4: bf16[10,64] = t(t_3)
view_2: bf16[2,4,4,4] = view(mm, [2, 4, 4, 4])
max_pool2d_with_indices_backward: bf16[2,4,8,8] = max_pool2d_with_indices_backward(view_2, relu, [2, 2], [2, 2], [0, 0], [1, 1], False, getitem_6)
detach_1: bf16[2,4,8,8] = detach(detach)
threshold_backward: bf16[2,4,8,8] = threshold_backward(max_pool2d_with_indices_backward, detach_1, 0)
native_batch_norm_backward: (bf16[2,4,8,8], f32[4], f32[4]) = native_batch_norm_backward(threshold_backward, convolution, primals_7, getitem_3, getitem_4, getitem_1, getitem_2, True, 1e-05, [True, True, True])
getitem_7: bf16[2,4,8,8] = getitem(native_batch_norm_backward, 0)
getitem_8: f32[4] = getitem(native_batch_norm_backward, 1)
getitem_9: f32[4] = getitem(native_batch_norm_backward, 2)
convolution_backward: (-, bf16[4,1,3,3], bf16[4]) = convolution_backward(getitem_7, _to_copy, _to_copy_1, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
getitem_11: bf16[4,1,3,3] = getitem(convolution_backward, 1)
getitem_12: bf16[4] = getitem(convolution_backward, 2)
_to_copy_7: f32[10] = _to_copy(view_1, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_8: f32[10,64] = _to_copy(t_4, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_9: f32[4] = _to_copy(getitem_12, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_10: f32[4,1,3,3] = _to_copy(getitem_11, dtype=f32, layout=torch.strided, device=device(type='cpu'))
return [_to_copy_10, _to_copy_9, None, None, None, None, getitem_8, getitem_9, _to_copy_8, _to_copy_7]""")

    def test_cnn_o2(self):
        fw, bw = _graphs(models.cnn, "O2")
        self.assertExpectedInline(fw, """\
args_0: f32[2,1,8,8]
conv_weight: bf16[4,1,3,3]
conv_bias: bf16[4]
bn_num_batches_tracked: i64[]
bn_running_mean: f32[4]
bn_running_var: f32[4]
bn_weight: f32[4]
bn_bias: f32[4]
fc_weight: bf16[10,64]
fc_bias: bf16[10]
to: bf16[2,1,8,8] = to.dtype(args_0, bf16)  # fxamp boundary
conv2d: bf16[2,4,8,8] = conv2d(to, conv_weight, conv_bias, [1, 1], [1, 1])
conv2d_f32: f32[2,4,8,8] = _to_copy(conv2d, dtype=f32)  # fxamp
add_: i64[] = add_.Tensor(bn_num_batches_tracked, 1)
batch_norm: f32[2,4,8,8] = batch_norm(conv2d_f32, bn_weight, bn_bias, bn_running_mean, bn_running_var, True, 0.1, 1e-05, True)
batch_norm_bf16: bf16[2,4,8,8] = _to_copy(batch_norm, dtype=bf16)  # fxamp
relu: bf16[2,4,8,8] = relu(batch_norm_bf16)
max_pool2d: bf16[2,4,4,4] = max_pool2d(relu, [2, 2], [2, 2])
flatten: bf16[2,64] = flatten.using_ints(max_pool2d, 1)
linear: bf16[2,10] = linear(flatten, fc_weight, fc_bias)
to_1: f32[2,10] = to.dtype(linear, f32)  # fxamp boundary
return [to_1]""")
        self.assertExpectedInline(bw, """\
primals_2: bf16[4,1,3,3]
primals_7: f32[4]
_to_copy: bf16[2,1,8,8]
_to_copy_1: f32[2,4,8,8]
getitem_1: f32[4]
getitem_2: f32[4]
getitem_3: f32[4]
getitem_4: f32[4]
relu: bf16[2,4,8,8]
detach: bf16[2,4,8,8]
getitem_6: i64[2,4,4,4]
view: bf16[2,64]
t: bf16[64,10]
tangents_1: f32[2,10]
_to_copy_4: bf16[2,10] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
t_1: bf16[10,64] = t(t)
mm: bf16[2,64] = mm(_to_copy_4, t_1)
t_2: bf16[10,2] = t(_to_copy_4)
mm_1: bf16[10,64] = mm(t_2, view)
t_3: bf16[64,10] = t(mm_1)
sum_1: bf16[1,10] = sum.dim_IntList(_to_copy_4, [0], True)
view_1: bf16[10] = view(sum_1, [10])
t_4: bf16[10,64] = t(t_3)
view_2: bf16[2,4,4,4] = view(mm, [2, 4, 4, 4])
max_pool2d_with_indices_backward: bf16[2,4,8,8] = max_pool2d_with_indices_backward(view_2, relu, [2, 2], [2, 2], [0, 0], [1, 1], False, getitem_6)
detach_1: bf16[2,4,8,8] = detach(detach)
threshold_backward: bf16[2,4,8,8] = threshold_backward(max_pool2d_with_indices_backward, detach_1, 0)
_to_copy_5: f32[2,4,8,8] = _to_copy(threshold_backward, dtype=f32, layout=torch.strided, device=device(type='cpu'))
native_batch_norm_backward: (f32[2,4,8,8], f32[4], f32[4]) = native_batch_norm_backward(_to_copy_5, _to_copy_1, primals_7, getitem_3, getitem_4, getitem_1, getitem_2, True, 1e-05, [True, True, True])
getitem_7: f32[2,4,8,8] = getitem(native_batch_norm_backward, 0)
getitem_8: f32[4] = getitem(native_batch_norm_backward, 1)
getitem_9: f32[4] = getitem(native_batch_norm_backward, 2)
_to_copy_6: bf16[2,4,8,8] = _to_copy(getitem_7, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
convolution_backward: (-, bf16[4,1,3,3], bf16[4]) = convolution_backward(_to_copy_6, _to_copy, primals_2, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
getitem_11: bf16[4,1,3,3] = getitem(convolution_backward, 1)
getitem_12: bf16[4] = getitem(convolution_backward, 2)
return [None, getitem_11, getitem_12, None, None, None, getitem_8, getitem_9, t_4, view_1]""")

    def test_attention_o1(self):
        fw, bw = _graphs(models.attention, "O1")
        self.assertExpectedInline(fw, """\
args_0: f32[2,8,16]
ln1_weight: f32[16]
ln1_bias: f32[16]
qkv_weight: f32[48,16]
qkv_bias: f32[48]
proj_weight: f32[16,16]
proj_bias: f32[16]
ln2_weight: f32[16]
ln2_bias: f32[16]
mlp_0_weight: f32[32,16]
mlp_0_bias: f32[32]
mlp_2_weight: f32[16,32]
mlp_2_bias: f32[16]
qkv_weight_bf16: bf16[48,16] = _to_copy(qkv_weight, dtype=bf16)  # fxamp
qkv_bias_bf16: bf16[48] = _to_copy(qkv_bias, dtype=bf16)  # fxamp
proj_weight_bf16: bf16[16,16] = _to_copy(proj_weight, dtype=bf16)  # fxamp
proj_bias_bf16: bf16[16] = _to_copy(proj_bias, dtype=bf16)  # fxamp
mlp_0_weight_bf16: bf16[32,16] = _to_copy(mlp_0_weight, dtype=bf16)  # fxamp
mlp_0_bias_bf16: bf16[32] = _to_copy(mlp_0_bias, dtype=bf16)  # fxamp
mlp_2_weight_bf16: bf16[16,32] = _to_copy(mlp_2_weight, dtype=bf16)  # fxamp
mlp_2_bias_bf16: bf16[16] = _to_copy(mlp_2_bias, dtype=bf16)  # fxamp
layer_norm: f32[2,8,16] = layer_norm(args_0, [16], ln1_weight, ln1_bias)
layer_norm_bf16: bf16[2,8,16] = _to_copy(layer_norm, dtype=bf16)  # fxamp
linear: bf16[2,8,48] = linear(layer_norm_bf16, qkv_weight_bf16, qkv_bias_bf16)
chunk: (bf16[2,8,16], bf16[2,8,16], bf16[2,8,16]) = chunk(linear, 3, -1)
getitem: bf16[2,8,16] = getitem(chunk, 0)
getitem_1: bf16[2,8,16] = getitem(chunk, 1)
getitem_2: bf16[2,8,16] = getitem(chunk, 2)
view: bf16[2,8,2,8] = view(getitem, [2, 8, 2, 8])
transpose: bf16[2,2,8,8] = transpose.int(view, 1, 2)
view_1: bf16[2,8,2,8] = view(getitem_1, [2, 8, 2, 8])
transpose_1: bf16[2,2,8,8] = transpose.int(view_1, 1, 2)
view_2: bf16[2,8,2,8] = view(getitem_2, [2, 8, 2, 8])
transpose_2: bf16[2,2,8,8] = transpose.int(view_2, 1, 2)
scaled_dot_product_attention: bf16[2,2,8,8] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, None, 0.0, True)
transpose_3: bf16[2,8,2,8] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: bf16[2,8,16] = reshape(transpose_3, [2, 8, 16])
linear_1: bf16[2,8,16] = linear(reshape, proj_weight_bf16, proj_bias_bf16)
add: f32[2,8,16] = add.Tensor(args_0, linear_1)
layer_norm_1: f32[2,8,16] = layer_norm(add, [16], ln2_weight, ln2_bias)
layer_norm_1_bf16: bf16[2,8,16] = _to_copy(layer_norm_1, dtype=bf16)  # fxamp
linear_2: bf16[2,8,32] = linear(layer_norm_1_bf16, mlp_0_weight_bf16, mlp_0_bias_bf16)
gelu: bf16[2,8,32] = gelu(linear_2)
linear_3: bf16[2,8,16] = linear(gelu, mlp_2_weight_bf16, mlp_2_bias_bf16)
add_1: f32[2,8,16] = add.Tensor(add, linear_3)
return [add_1]""")
        self.assertExpectedInline(bw, """\
primals_1: f32[2,8,16]
primals_2: f32[16]
primals_3: f32[16]
primals_8: f32[16]
primals_9: f32[16]
getitem_1: f32[2,8,1]
getitem_2: f32[2,8,1]
view: bf16[16,16]
t: bf16[16,48]
transpose: bf16[2,2,8,8]
transpose_1: bf16[2,2,8,8]
transpose_2: bf16[2,2,8,8]
getitem_7: f32[2,2,8]
detach: bf16[2,2,8,8]
view_6: bf16[16,16]
t_1: bf16[16,16]
add: f32[2,8,16]
getitem_9: f32[2,8,1]
getitem_10: f32[2,8,1]
view_8: bf16[16,16]
t_2: bf16[16,32]
view_9: bf16[2,8,32]
view_10: bf16[16,32]
t_3: bf16[32,16]
tangents_1: f32[2,8,16]
_to_copy_10: bf16[2,8,16] = _to_copy(tangents_1, dtype=bf16)
view_12: bf16[16,16] = view(_to_copy_10, [16, 16])
t_4: bf16[16,32] = t(t_3)
mm: bf16[16,32] = mm(view_12, t_4)
t_5: bf16[16,16] = t(view_12)
mm_1: bf16[16,32] = mm(t_5, view_10)
t_6: bf16[32,16] = t(mm_1)
sum_1: bf16[1,16] = sum.dim_IntList(view_12, [0], True)
view_13: bf16[16] = view(sum_1, [16])
t_7: bf16[16,32] = t(t_6)
view_14: bf16[2,8,32] = view(mm, [2, 8, 32])
gelu_backward: bf16[2,8,32] = gelu_backward(view_14, view_9)
view_15: bf16[16,32] = view(gelu_backward, [16, 32])
t_8: bf16[32,16] = t(t_2)
mm_2: bf16[16,16] = mm(view_15, t_8)
t_9: bf16[32,16] = t(view_15)
mm_3: bf16[32,16] = mm(t_9, view_8)
t_10: bf16[16,32] = t(mm_3)
sum_2: bf16[1,32] = sum.dim_IntList(view_15, [0], True)
view_16: bf16[32] = view(sum_2, [32])
t_11: bf16[32,16] = t(t_10)
view_17: bf16[2,8,16] = view(mm_2, [2, 8, 16])
_to_copy_11: f32[2,8,16] = _to_copy(view_17, dtype=f32, layout=torch.strided, device=device(type='cpu'))
native_layer_norm_backward: (f32[2,8,16], f32[16], f32[16]) = native_layer_norm_backward(_to_copy_11, add, [16], getitem_9, getitem_10, primals_8, primals_9, [True, True, True])
getitem_11: f32[2,8,16] = getitem(native_layer_norm_backward, 0)
getitem_12: f32[16] = getitem(native_layer_norm_backward, 1)
getitem_13: f32[16] = getitem(native_layer_norm_backward, 2)
add_2: f32[2,8,16] = add.Tensor(tangents_1, getitem_11)
_to_copy_12: bf16[2,8,16] = _to_copy(add_2, dtype=bf16)
view_18: bf16[16,16] = view(_to_copy_12, [16, 16])
t_12: bf16[16,16] = t(t_1)
mm_4: bf16[16,16] = mm(view_18, t_12)
t_13: bf16[16,16] = t(view_18)
mm_5: bf16[16,16] = mm(t_13, view_6)
t_14: bf16[16,16] = t(mm_5)
sum_3: bf16[1,16] = sum.dim_IntList(view_18, [0], True)
view_19: bf16[16] = view(sum_3, [16])
t_15: bf16[16,16] = t(t_14)
view_20: bf16[2,8,16] = view(mm_4, [2, 8, 16])
view_21: bf16[2,8,2,8] = view(view_20, [2, 8, 2, 8])
transpose_4: bf16[2,2,8,8] = transpose.int(view_21, 1, 2)
detach_1: bf16[2,2,8,8] = detach(detach)
_scaled_dot_product_flash_attention_for_cpu_backward: (bf16[2,2,8,8], bf16[2,2,8,8], bf16[2,2,8,8]) = _scaled_dot_product_flash_attention_for_cpu_backward(transpose_4, transpose, transpose_1, transpose_2, detach_1, getitem_7, 0.0, True)
getitem_14: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 0)
getitem_15: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 1)
getitem_16: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 2)
transpose_5: bf16[2,8,2,8] = transpose.int(getitem_16, 1, 2)
view_22: bf16[2,8,16] = view(transpose_5, [2, 8, 16])
transpose_6: bf16[2,8,2,8] = transpose.int(getitem_15, 1, 2)
view_23: bf16[2,8,16] = view(transpose_6, [2, 8, 16])
transpose_7: bf16[2,8,2,8] = transpose.int(getitem_14, 1, 2)
view_24: bf16[2,8,16] = view(transpose_7, [2, 8, 16])
cat: bf16[2,8,48] = cat([view_24, view_23, view_22], 2)
view_25: bf16[16,48] = view(cat, [16, 48])
t_16: bf16[48,16] = t(t)
mm_6: bf16[16,16] = mm(view_25, t_16)
t_17: bf16[48,16] = t(view_25)
mm_7: bf16[48,16] = mm(t_17, view)
t_18: bf16[16,48] = t(mm_7)
sum_4: bf16[1,48] = sum.dim_IntList(view_25, [0], True)
view_26: bf16[48] = view(sum_4, [48])
t_19: bf16[48,16] = t(t_18)
view_27: bf16[2,8,16] = view(mm_6, [2, 8, 16])
_to_copy_13: f32[2,8,16] = _to_copy(view_27, dtype=f32, layout=torch.strided, device=device(type='cpu'))
native_layer_norm_backward_1: (-, f32[16], f32[16]) = native_layer_norm_backward(_to_copy_13, primals_1, [16], getitem_1, getitem_2, primals_2, primals_3, [False, True, True])
getitem_18: f32[16] = getitem(native_layer_norm_backward_1, 1)
getitem_19: f32[16] = getitem(native_layer_norm_backward_1, 2)
_to_copy_14: f32[16] = _to_copy(view_13, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_15: f32[16,32] = _to_copy(t_7, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_16: f32[32] = _to_copy(view_16, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_17: f32[32,16] = _to_copy(t_11, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_18: f32[16] = _to_copy(view_19, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_19: f32[16,16] = _to_copy(t_15, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_20: f32[48] = _to_copy(view_26, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_21: f32[48,16] = _to_copy(t_19, dtype=f32, layout=torch.strided, device=device(type='cpu'))
return [None, getitem_18, getitem_19, _to_copy_21, _to_copy_20, _to_copy_19, _to_copy_18, getitem_12, getitem_13, _to_copy_17, _to_copy_16, _to_copy_15, _to_copy_14]""")

    def test_attention_o2(self):
        fw, bw = _graphs(models.attention, "O2")
        self.assertExpectedInline(fw, """\
args_0: f32[2,8,16]
ln1_weight: bf16[16]
ln1_bias: bf16[16]
qkv_weight: bf16[48,16]
qkv_bias: bf16[48]
proj_weight: bf16[16,16]
proj_bias: bf16[16]
ln2_weight: bf16[16]
ln2_bias: bf16[16]
mlp_0_weight: bf16[32,16]
mlp_0_bias: bf16[32]
mlp_2_weight: bf16[16,32]
mlp_2_bias: bf16[16]
to: bf16[2,8,16] = to.dtype(args_0, bf16)  # fxamp boundary
layer_norm: bf16[2,8,16] = layer_norm(to, [16], ln1_weight, ln1_bias)
linear: bf16[2,8,48] = linear(layer_norm, qkv_weight, qkv_bias)
chunk: (bf16[2,8,16], bf16[2,8,16], bf16[2,8,16]) = chunk(linear, 3, -1)
getitem: bf16[2,8,16] = getitem(chunk, 0)
getitem_1: bf16[2,8,16] = getitem(chunk, 1)
getitem_2: bf16[2,8,16] = getitem(chunk, 2)
view: bf16[2,8,2,8] = view(getitem, [2, 8, 2, 8])
transpose: bf16[2,2,8,8] = transpose.int(view, 1, 2)
view_1: bf16[2,8,2,8] = view(getitem_1, [2, 8, 2, 8])
transpose_1: bf16[2,2,8,8] = transpose.int(view_1, 1, 2)
view_2: bf16[2,8,2,8] = view(getitem_2, [2, 8, 2, 8])
transpose_2: bf16[2,2,8,8] = transpose.int(view_2, 1, 2)
scaled_dot_product_attention: bf16[2,2,8,8] = scaled_dot_product_attention(transpose, transpose_1, transpose_2, None, 0.0, True)
transpose_3: bf16[2,8,2,8] = transpose.int(scaled_dot_product_attention, 1, 2)
reshape: bf16[2,8,16] = reshape(transpose_3, [2, 8, 16])
linear_1: bf16[2,8,16] = linear(reshape, proj_weight, proj_bias)
add: bf16[2,8,16] = add.Tensor(to, linear_1)
layer_norm_1: bf16[2,8,16] = layer_norm(add, [16], ln2_weight, ln2_bias)
linear_2: bf16[2,8,32] = linear(layer_norm_1, mlp_0_weight, mlp_0_bias)
gelu: bf16[2,8,32] = gelu(linear_2)
linear_3: bf16[2,8,16] = linear(gelu, mlp_2_weight, mlp_2_bias)
add_1: bf16[2,8,16] = add.Tensor(add, linear_3)
to_1: f32[2,8,16] = to.dtype(add_1, f32)  # fxamp boundary
return [to_1]""")
        self.assertExpectedInline(bw, """\
primals_2: bf16[16]
primals_3: bf16[16]
primals_8: bf16[16]
primals_9: bf16[16]
_to_copy: bf16[2,8,16]
getitem_1: bf16[2,8,1]
getitem_2: bf16[2,8,1]
view: bf16[16,16]
t: bf16[16,48]
transpose: bf16[2,2,8,8]
transpose_1: bf16[2,2,8,8]
transpose_2: bf16[2,2,8,8]
getitem_7: f32[2,2,8]
detach: bf16[2,2,8,8]
view_6: bf16[16,16]
t_1: bf16[16,16]
add: bf16[2,8,16]
getitem_9: bf16[2,8,1]
getitem_10: bf16[2,8,1]
view_8: bf16[16,16]
t_2: bf16[16,32]
view_9: bf16[2,8,32]
view_10: bf16[16,32]
t_3: bf16[32,16]
tangents_1: f32[2,8,16]
_to_copy_2: bf16[2,8,16] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
view_12: bf16[16,16] = view(_to_copy_2, [16, 16])
t_4: bf16[16,32] = t(t_3)
mm: bf16[16,32] = mm(view_12, t_4)
t_5: bf16[16,16] = t(view_12)
mm_1: bf16[16,32] = mm(t_5, view_10)
t_6: bf16[32,16] = t(mm_1)
sum_1: bf16[1,16] = sum.dim_IntList(view_12, [0], True)
view_13: bf16[16] = view(sum_1, [16])
t_7: bf16[16,32] = t(t_6)
view_14: bf16[2,8,32] = view(mm, [2, 8, 32])
gelu_backward: bf16[2,8,32] = gelu_backward(view_14, view_9)
view_15: bf16[16,32] = view(gelu_backward, [16, 32])
t_8: bf16[32,16] = t(t_2)
mm_2: bf16[16,16] = mm(view_15, t_8)
t_9: bf16[32,16] = t(view_15)
mm_3: bf16[32,16] = mm(t_9, view_8)
t_10: bf16[16,32] = t(mm_3)
sum_2: bf16[1,32] = sum.dim_IntList(view_15, [0], True)
view_16: bf16[32] = view(sum_2, [32])
t_11: bf16[32,16] = t(t_10)
view_17: bf16[2,8,16] = view(mm_2, [2, 8, 16])
native_layer_norm_backward: (bf16[2,8,16], bf16[16], bf16[16]) = native_layer_norm_backward(view_17, add, [16], getitem_9, getitem_10, primals_8, primals_9, [True, True, True])
getitem_11: bf16[2,8,16] = getitem(native_layer_norm_backward, 0)
getitem_12: bf16[16] = getitem(native_layer_norm_backward, 1)
getitem_13: bf16[16] = getitem(native_layer_norm_backward, 2)
add_2: bf16[2,8,16] = add.Tensor(_to_copy_2, getitem_11)
view_18: bf16[16,16] = view(add_2, [16, 16])
t_12: bf16[16,16] = t(t_1)
mm_4: bf16[16,16] = mm(view_18, t_12)
t_13: bf16[16,16] = t(view_18)
mm_5: bf16[16,16] = mm(t_13, view_6)
t_14: bf16[16,16] = t(mm_5)
sum_3: bf16[1,16] = sum.dim_IntList(view_18, [0], True)
view_19: bf16[16] = view(sum_3, [16])
t_15: bf16[16,16] = t(t_14)
view_20: bf16[2,8,16] = view(mm_4, [2, 8, 16])
view_21: bf16[2,8,2,8] = view(view_20, [2, 8, 2, 8])
transpose_4: bf16[2,2,8,8] = transpose.int(view_21, 1, 2)
detach_1: bf16[2,2,8,8] = detach(detach)
_scaled_dot_product_flash_attention_for_cpu_backward: (bf16[2,2,8,8], bf16[2,2,8,8], bf16[2,2,8,8]) = _scaled_dot_product_flash_attention_for_cpu_backward(transpose_4, transpose, transpose_1, transpose_2, detach_1, getitem_7, 0.0, True)
getitem_14: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 0)
getitem_15: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 1)
getitem_16: bf16[2,2,8,8] = getitem(_scaled_dot_product_flash_attention_for_cpu_backward, 2)
transpose_5: bf16[2,8,2,8] = transpose.int(getitem_16, 1, 2)
view_22: bf16[2,8,16] = view(transpose_5, [2, 8, 16])
transpose_6: bf16[2,8,2,8] = transpose.int(getitem_15, 1, 2)
view_23: bf16[2,8,16] = view(transpose_6, [2, 8, 16])
transpose_7: bf16[2,8,2,8] = transpose.int(getitem_14, 1, 2)
view_24: bf16[2,8,16] = view(transpose_7, [2, 8, 16])
cat: bf16[2,8,48] = cat([view_24, view_23, view_22], 2)
view_25: bf16[16,48] = view(cat, [16, 48])
t_16: bf16[48,16] = t(t)
mm_6: bf16[16,16] = mm(view_25, t_16)
t_17: bf16[48,16] = t(view_25)
mm_7: bf16[48,16] = mm(t_17, view)
t_18: bf16[16,48] = t(mm_7)
sum_4: bf16[1,48] = sum.dim_IntList(view_25, [0], True)
view_26: bf16[48] = view(sum_4, [48])
t_19: bf16[48,16] = t(t_18)
view_27: bf16[2,8,16] = view(mm_6, [2, 8, 16])
native_layer_norm_backward_1: (-, bf16[16], bf16[16]) = native_layer_norm_backward(view_27, _to_copy, [16], getitem_1, getitem_2, primals_2, primals_3, [False, True, True])
getitem_18: bf16[16] = getitem(native_layer_norm_backward_1, 1)
getitem_19: bf16[16] = getitem(native_layer_norm_backward_1, 2)
return [None, getitem_18, getitem_19, t_19, view_26, t_15, view_19, getitem_12, getitem_13, t_11, view_16, t_7, view_13]""")


