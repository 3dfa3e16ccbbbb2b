"""No silent zero: every operation a traced step runs is either counted or known to be FLOP-free.

`FlopCounterMode` counts the operations in its registry (matmuls, convolutions, SDPA kernels)
and counts everything else as zero. That is right for what meshplan calls FLOPs (matmul and
attention FLOPs, the model-FLOPs convention; elementwise work, norms, reductions and data
movement are costed as memory-bound time from the saved bytes) but silently wrong for a matmul
the registry does not know, such as `aten._grouped_mm`, which transformers 5.x runs its MoE
experts through. So:

- meshplan registers formulas for the matmul-like operations torch's registry lacks
  (`flop_formulas`: grouped and scaled-grouped matmuls, the CPU flash-attention kernel and the
  overrideable fused attention), and one where torch's is wrong (the backward of a grouped
  convolution, which torch prices as a dense one);
- `OpAudit`, a dispatch mode inside the counter, records every operation that has no formula and
  is not known FLOP-free: tagged pointwise, a view, or listed in `FLOP_FREE_OPS` (creation, copies,
  indexing, reductions, normalisation, softmax, losses, sorting, and their backward kernels), all
  in the `aten` namespace. The profiler refuses a model that ran any such operation, naming it;
- the meta kernel of `aten._grouped_mm` accepts only bf16 inputs although the CUDA kernel takes
  fp16 and fp32 too: `OpAudit` runs a meta fp16/fp32 grouped matmul through bf16 and casts the
  result back (same shapes, same FLOPs; autograd saves the fp32 tensors the model passed).
"""
from __future__ import annotations

import math
from typing import Any

# Non-pointwise, non-view aten operations that do no matmul work, by what they do.
FLOP_FREE_OPS = frozenset("""
    empty empty_like empty_strided new_empty new_empty_strided new_zeros new_ones new_full zeros zeros_like ones
    ones_like full full_like arange scalar_tensor lift_fresh lift_fresh_copy rand rand_like randn randn_like randint
    bernoulli bernoulli_ native_dropout native_dropout_backward normal_ uniform_ fill_ zero_ tril triu tril_ triu_
    eye linspace polar complex view_as_complex view_as_real _conj conj_physical
    clone copy_ _to_copy _unsafe_view cat stack split split_with_sizes chunk unbind repeat repeat_interleave roll
    flip constant_pad_nd _reshape_alias alias detach expand index index_select index_put index_put_ _index_put_impl_
    index_add index_add_ index_copy index_copy_ gather scatter scatter_ scatter_add scatter_add_ scatter_reduce
    scatter_reduce_ masked_fill masked_fill_ masked_scatter masked_select where embedding embedding_dense_backward
    slice_backward select_backward select_scatter slice_scatter diagonal_scatter as_strided_scatter _unsafe_index
    _unsafe_index_put one_hot narrow take nonzero unfold_backward
    sum mean amax amin max min argmax argmin prod var var_mean std std_mean logsumexp norm linalg_vector_norm
    cumsum cumprod any all count_nonzero
    _softmax _log_softmax _softmax_backward_data _log_softmax_backward_data _safe_softmax
    native_layer_norm native_layer_norm_backward native_group_norm native_group_norm_backward native_batch_norm
    native_batch_norm_backward _native_batch_norm_legit _native_batch_norm_legit_functional
    _native_batch_norm_legit_no_training _fused_rms_norm _fused_rms_norm_backward
    nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward mse_loss mse_loss_backward
    binary_cross_entropy binary_cross_entropy_backward binary_cross_entropy_with_logits smooth_l1_loss
    smooth_l1_loss_backward
    sort topk histc bincount searchsorted argsort kthvalue bucketize isin _unique2 unique_consecutive
    floor_divide remainder fmod equal is_same_size _assert_async _assert_scalar _assert_tensor_metadata
    _functional_assert_async sym_size sym_numel sym_stride sym_storage_offset resize_ set_ record_stream
    t transpose permute view unsqueeze squeeze slice select as_strided expand_as _local_scalar_dense
    max_pool2d_with_indices max_pool2d_with_indices_backward avg_pool2d avg_pool2d_backward
    _adaptive_avg_pool2d _adaptive_avg_pool2d_backward upsample_nearest2d upsample_nearest2d_backward
    upsample_bilinear2d upsample_bilinear2d_backward im2col col2im
""".split())


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x (output elements) x (contraction length): 2-D x 3-D (tokens sorted by expert times each
    expert's weight) is 2 M N K whatever the offsets; 3-D x 3-D a batched matmul; 2-D x 2-D (the
    weight gradient, groups along K) an (G, M, N) output of which each group sums over its own
    slice of K, 2 M N K in all."""
    elements = math.prod(out_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:
        elements //= out_shape[0]
    return 2 * elements * a_shape[-1]


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """Each gradient (input, weight) does the forward's multiply-adds once more. torch's own formula
    prices the weight gradient as a dense convolution whatever the groups, 5,120 times too much
    for Mamba's depthwise conv1d of 5,120 channels."""
    from torch.utils.flop_counter import conv_flop_count

    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), bool(transposed))
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def flop_formulas() -> dict[Any, Any]:
    """`FlopCounterMode(custom_mapping=...)`: formulas for matmul-like operations torch's registry
    lacks (the attention ones reuse torch's own SDPA formulas)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas: dict[Any, Any] = {aten._grouped_mm: _grouped_mm_flop, aten.convolution_backward: _conv_backward_flop}
    if hasattr(aten, "_scaled_grouped_mm"):
        formulas[aten._scaled_grouped_mm] = _grouped_mm_flop
    forward = flop_registry[aten._scaled_dot_product_flash_attention]
    backward = flop_registry[aten._scaled_dot_product_flash_attention_backward]
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", forward),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
                          ("_scaled_dot_product_fused_attention_overrideable", forward),
                          ("_scaled_dot_product_fused_attention_overrideable_backward", backward)):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = formula
    return formulas


def is_flop_free(func) -> bool:
    """Whether an operation does no matmul work: an aten (or prims) op that is pointwise, a view or
    in FLOP_FREE_OPS (a backward kernel of one of those included)."""
    import torch

    packet = func.overloadpacket
    if not str(packet).startswith(("aten.", "prims.")):
        return False
    if torch.Tag.pointwise in getattr(func, "tags", ()) or getattr(func, "is_view", False):
        return True
    name = str(packet).split(".", 1)[1]
    forward = name.removesuffix("_backward_data").removesuffix("_backward")
    return name in FLOP_FREE_OPS or name.rstrip("_") in FLOP_FREE_OPS or (
        forward != name and _forward_is_pointwise(forward))


def _forward_is_pointwise(name: str) -> bool:
    """`silu_backward` and the like: the backward of a pointwise op is pointwise work."""
    import torch

    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, overload).tags for overload in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


def op_audit_mode(registry: dict, counter=None):
    """A dispatch mode (enter it inside the FlopCounterMode) whose `uncounted` collects the names of
    operations with no formula in `registry` that are not FLOP-free. With the enclosing `counter`,
    its `conv_flops` is the running total of the FLOPs convolutions (forward and backward) added
    to it: the counter sits below this mode, so an op's FLOPs are its total's change across the op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    grouped_mm = torch.ops.aten._grouped_mm.default
    convolutions = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward, torch.ops.aten._convolution}

    class OpAudit(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.uncounted: dict[str, int] = {}
            self.checked: dict[Any, bool] = {}
            self.conv_flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            counted = self.checked.get(func)
            if counted is None:
                counted = self.checked[func] = func.overloadpacket in registry or is_flop_free(func)
            if not counted:
                name = str(func.overloadpacket)
                self.uncounted[name] = self.uncounted.get(name, 0) + 1
            if func is grouped_mm and _meta_non_bf16(args):
                return _grouped_mm_through_bf16(func, args, kwargs)
            if counter is not None and func.overloadpacket in convolutions:
                before = counter.get_total_flops()
                out = func(*args, **kwargs)
                self.conv_flops += counter.get_total_flops() - before
                return out
            return func(*args, **kwargs)

    return OpAudit()


def _meta_non_bf16(args) -> bool:
    import torch

    a, b = args[0], args[1]
    return a.device.type == "meta" and (a.dtype, b.dtype) != (torch.bfloat16, torch.bfloat16)


def _grouped_mm_through_bf16(func, args, kwargs):
    import torch

    dtype = kwargs.get("out_dtype") or args[0].dtype
    cast = [arg.to(torch.bfloat16) if i < 2 else arg for i, arg in enumerate(args)]
    return func(*cast, **{k: v for k, v in kwargs.items() if k != "out_dtype"}).to(dtype)
