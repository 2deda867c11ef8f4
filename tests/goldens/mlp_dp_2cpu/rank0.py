# adaptdist 0.1.0 RankProgram, torch 2.13.0+cpu
# rank 0 of 2, mesh dp=2 (this rank: dp=0), batch rows [0, 4) of 7
# outputs: loss, grad:fc1.weight, grad:fc1.bias, grad:fc2.weight, ... (5 in all)
# Generated code: edit the model, not this file.
# inputs:
#   arg0_1: fc1.weight
#   arg1_1: fc1.bias
#   arg2_1: fc2.weight
#   arg3_1: fc2.bias
#   arg4_1: batch[0] (local rows)
#   arg5_1: batch[1] (local rows)
import torch
from torch import device


class RankProgramModule(torch.nn.Module):
    def forward(self, arg0_1: "f32[24, 12]", arg1_1: "f32[24]", arg2_1: "f32[5, 24]", arg3_1: "f32[5]", arg4_1: "f32[4, 12]", arg5_1: "i64[4]"):
        t = torch.ops.aten.t.default(arg0_1);  arg0_1 = None  # f32[12, 24]
        addmm = torch.ops.aten.addmm.default(arg1_1, arg4_1, t);  arg1_1 = t = None  # f32[4, 24]
        tanh = torch.ops.aten.tanh.default(addmm);  addmm = None  # f32[4, 24]
        detach_1 = torch.ops.aten.detach.default(tanh)  # f32[4, 24]
        t_1 = torch.ops.aten.t.default(arg2_1);  arg2_1 = None  # f32[24, 5]
        addmm_1 = torch.ops.aten.addmm.default(arg3_1, tanh, t_1);  arg3_1 = None  # f32[4, 5]
        _log_softmax = torch.ops.aten._log_softmax.default(addmm_1, 1, False);  addmm_1 = None  # f32[4, 5]
        detach_3 = torch.ops.aten.detach.default(_log_softmax)  # f32[4, 5]
        nll_loss_forward = torch.ops.aten.nll_loss_forward.default(_log_softmax, arg5_1, None, 2, -100)
        getitem = nll_loss_forward[0]  # f32[]
        getitem_1 = nll_loss_forward[1];  nll_loss_forward = None  # f32[]
        all_reduce_default = torch.ops._c10d_functional.all_reduce.default(getitem_1, 'sum', 'adaptdist:dp');  getitem_1 = None  # f32[]
        wait_tensor_default = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default);  all_reduce_default = None  # f32[]
        div_tensor = torch.ops.aten.div.Tensor(getitem, wait_tensor_default);  getitem = None  # f32[]
        all_reduce_default_1 = torch.ops._c10d_functional.all_reduce.default(div_tensor, 'sum', 'adaptdist:dp')  # f32[]
        wait_tensor_default_1 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_1);  all_reduce_default_1 = None  # f32[]
        ones_like = torch.ops.aten.ones_like.default(div_tensor, pin_memory = False, memory_format = torch.preserve_format);  div_tensor = None  # f32[]
        nll_loss_backward = torch.ops.aten.nll_loss_backward.default(ones_like, _log_softmax, arg5_1, None, 1, -100, wait_tensor_default);  ones_like = _log_softmax = arg5_1 = wait_tensor_default = None  # f32[4, 5]
        detach_4 = torch.ops.aten.detach.default(detach_3);  detach_3 = None  # f32[4, 5]
        _log_softmax_backward_data = torch.ops.aten._log_softmax_backward_data.default(nll_loss_backward, detach_4, 1, torch.float32);  nll_loss_backward = detach_4 = None  # f32[4, 5]
        t_2 = torch.ops.aten.t.default(t_1);  t_1 = None  # f32[5, 24]
        mm = torch.ops.aten.mm.default(_log_softmax_backward_data, t_2);  t_2 = None  # f32[4, 24]
        t_3 = torch.ops.aten.t.default(_log_softmax_backward_data)  # f32[5, 4]
        mm_1 = torch.ops.aten.mm.default(t_3, tanh);  t_3 = tanh = None  # f32[5, 24]
        t_4 = torch.ops.aten.t.default(mm_1);  mm_1 = None  # f32[24, 5]
        sum_1 = torch.ops.aten.sum.dim_IntList(_log_softmax_backward_data, [0], True);  _log_softmax_backward_data = None  # f32[1, 5]
        view = torch.ops.aten.reshape.default(sum_1, [5]);  sum_1 = None  # f32[5]
        t_5 = torch.ops.aten.t.default(t_4);  t_4 = None  # f32[5, 24]
        detach_5 = torch.ops.aten.detach.default(detach_1);  detach_1 = None  # f32[4, 24]
        tanh_backward = torch.ops.aten.tanh_backward.default(mm, detach_5);  mm = detach_5 = None  # f32[4, 24]
        t_6 = torch.ops.aten.t.default(tanh_backward)  # f32[24, 4]
        mm_2 = torch.ops.aten.mm.default(t_6, arg4_1);  t_6 = arg4_1 = None  # f32[24, 12]
        t_7 = torch.ops.aten.t.default(mm_2);  mm_2 = None  # f32[12, 24]
        sum_2 = torch.ops.aten.sum.dim_IntList(tanh_backward, [0], True);  tanh_backward = None  # f32[1, 24]
        view_1 = torch.ops.aten.reshape.default(sum_2, [24]);  sum_2 = None  # f32[24]
        t_8 = torch.ops.aten.t.default(t_7);  t_7 = None  # f32[24, 12]
        reshape_default = torch.ops.aten.reshape.default(view, [-1]);  view = None  # f32[5]
        reshape_default_1 = torch.ops.aten.reshape.default(t_5, [-1]);  t_5 = None  # f32[120]
        reshape_default_2 = torch.ops.aten.reshape.default(view_1, [-1]);  view_1 = None  # f32[24]
        reshape_default_3 = torch.ops.aten.reshape.default(t_8, [-1]);  t_8 = None  # f32[288]
        cat_default = torch.ops.aten.cat.default([reshape_default, reshape_default_1, reshape_default_2, reshape_default_3]);  reshape_default = reshape_default_1 = reshape_default_2 = reshape_default_3 = None  # f32[437]
        all_reduce_default_2 = torch.ops._c10d_functional.all_reduce.default(cat_default, 'sum', 'adaptdist:dp');  cat_default = None  # f32[437]
        wait_tensor_default_2 = torch.ops._c10d_functional.wait_tensor.default(all_reduce_default_2);  all_reduce_default_2 = None  # f32[437]
        split_with_sizes_default = torch.ops.aten.split_with_sizes.default(wait_tensor_default_2, [5, 120, 24, 288]);  wait_tensor_default_2 = None
        getitem_2 = split_with_sizes_default[0]  # f32[5]
        view_default = torch.ops.aten.reshape.default(getitem_2, [5]);  getitem_2 = None  # f32[5]
        getitem_3 = split_with_sizes_default[1]  # f32[120]
        view_default_1 = torch.ops.aten.reshape.default(getitem_3, [5, 24]);  getitem_3 = None  # f32[5, 24]
        getitem_4 = split_with_sizes_default[2]  # f32[24]
        view_default_2 = torch.ops.aten.reshape.default(getitem_4, [24]);  getitem_4 = None  # f32[24]
        getitem_5 = split_with_sizes_default[3];  split_with_sizes_default = None  # f32[288]
        view_default_3 = torch.ops.aten.reshape.default(getitem_5, [24, 12]);  getitem_5 = None  # f32[24, 12]
        return (wait_tensor_default_1, view_default_3, view_default_2, view_default_1, view_default)
