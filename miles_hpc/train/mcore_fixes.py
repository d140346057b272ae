"""Fixes to megatron-core 0.16 without Transformer Engine (what the megatron backend builds on), applied once when
`train/mcore_model.py` imports this module, as later megatron-core releases fix them (stage: train)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel as _DistributedDataParallel
from megatron.core.extensions import transformer_engine as _te_extension
from megatron.core.optimizer import optimizer_config as _optimizer_config
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as _HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as _DistributedOptimizer
from megatron.core.transformer import multi_latent_attention as _mla_module
from megatron.core.transformer.moe import moe_utils as _moe_utils

# megatron-core 0.16 without Transformer Engine (what this backend builds on), fixed at import as later releases do:
if not hasattr(_moe_utils, "te_general_gemm"):
    # its MoE router's gating tests an undefined `te_general_gemm` against None on CUDA (a NameError on every MoE
    # model on a GPU); 0.17+ define it as None.
    _moe_utils.te_general_gemm = None
if not _te_extension.HAVE_TE:
    # MLA sets its HAVE_TE when the TE extension imports, which it does without TE (a mock in TE's place), then
    # tests `isinstance(linear_proj, TELinear)` against that mock (a TypeError building any MLA model); the
    # extension's own HAVE_TE says whether TE is there (0.19 reads that one).
    _mla_module.HAVE_TE = False
    # The precision-aware optimizer's config check compares TE's version, None without TE (a TypeError); the check
    # only picks TE's parameter-remainder storage, which the CPU-offload optimizer (the one TE-less path) ignores.
    _optimizer_config.is_te_min_version = lambda *args, **kwargs: False


def _leaf_fp32_shards(build: Any) -> Any:
    """megatron-core 0.16's distributed optimizer hands the optimizer its shards of float32 parameters as views that
    autograd tracks (non-leaf); the CPU-offload optimizer builds torch optimizers over them, which refuse them
    ("can't optimize a non-leaf Tensor"). With offload on, each such shard is replaced by the same view detached
    (same storage, the parallel attributes kept), wherever megatron keeps it."""

    def wrapped(cls: Any, gbuf_ranges: Any, param_gbuf_map: Any, opt_group_ranges: Any, config: Any) -> Any:
        out = build.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if not config.optimizer_cpu_offload:
            return out
        swap: dict[int, torch.Tensor] = {}
        for group in out[3]:  # shard_fp32_groups
            for i, shard in enumerate(group):
                if not shard.is_leaf:
                    leaf = shard.detach()
                    leaf.__dict__.update(shard.__dict__)
                    swap[id(shard)] = group[i] = leaf
        for group_range in opt_group_ranges:
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [swap.get(id(q), q) for q in params]
        return out

    return classmethod(wrapped)


_DistributedOptimizer._build_model_and_main_param_groups = _leaf_fp32_shards(
    _DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
)


def gpu_share_grads(hdo: Any) -> None:
    """megatron-core 0.16's HybridDeviceOptimizer (the CPU-offload optimizer) steps the parameters it keeps on the GPU
    (the share `1 - optimizer_offload_fraction`) with torch's AdamW, which reads `.grad`; it fills `.grad` only on the
    float32 copies it makes of 16-bit parameters. The precision-aware distributed optimizer hands over its gradients
    in `.decoupled_grad`, so every float32 parameter kept on the GPU (all of a float32 model's share; a bf16 model's
    float32 router and norm weights) had no `.grad` and never stepped: an H200 found offload 0.5 unlike FSDP (loss
    0.00024 against 0.00095) while 1.0 (nothing kept on the GPU) agreed. Here such a parameter's `.grad` is its
    `.decoupled_grad` (the same float32 tensor: megatron's gradient buffer, clipped and scaled in place)."""
    if hdo.gpu_optimizer is None:
        return
    for group in hdo.gpu_optimizer.param_groups:
        for param in group["params"]:
            if param in hdo.fp32_param_to_orig_param:
                continue  # a float32 copy of a 16-bit parameter: filled by megatron from that parameter
            grad = getattr(param, "decoupled_grad", None)
            if grad is not None:
                param.grad = grad


def _hybrid_set_grads(set_grads: Any) -> Any:
    def wrapped(self: Any) -> None:
        set_grads(self)
        gpu_share_grads(self)

    return wrapped


def _hybrid_init(init: Any) -> Any:
    """The same optimizer casts the GPU share's gradients to float32 on its side stream (with
    overlap_cpu_optimizer_d2h_h2d) and steps the GPU share on the current stream without waiting for it: its AdamW
    may read a gradient not yet written. Each GPU sub-optimizer it builds (at start and after a state load) waits for
    that stream first."""

    def wrapped(self: Any) -> None:
        init(self)
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.register_step_pre_hook(
                lambda *_: torch.cuda.current_stream().wait_stream(self._d2h_stream)
            )

    return wrapped


def restore_masters(hdo: Any) -> None:
    """megatron-core 0.16's HybridDeviceOptimizer, after a state load, writes each parameter's loaded master weights
    (`state[p]["master_param"]`) into the float32 copy it keeps of a 16-bit parameter, and looks every parameter up
    among those copies: a float32 parameter has none (a KeyError: a float32 model's, or a bf16 model's float32 router
    and norm weights, failed to resume on a GPU), and a float32 parameter it offloaded keeps its host copy unloaded.
    Here the master goes to whatever the sub-optimizer steps: the float32 copy, the host copy, or the parameter."""
    if not hdo.param_update_in_fp32:
        return
    for param, state in hdo.state.items():
        master = state.get("master_param")
        inner = hdo.param_to_inner_param.get(param, param)
        if master is not None and inner is not master:
            inner.data.copy_(master)


def state_to_param_devices(hdo: Any) -> None:
    """megatron-core 0.16's HybridDeviceOptimizer, after a state load, moves each sub-optimizer's loaded state to
    the host when that sub-optimizer is an instance of its CPU optimizer's class, else to the GPU. Without
    Transformer Engine and Apex both classes are torch's AdamW, so the state of the share kept on the GPU went to the
    host too, and its first step failed ("exp_avgs is on cpu, different from other tensors on cuda:0": an H100
    resuming offload 0.5). Here each state tensor goes to the device of the parameter its sub-optimizer steps."""
    for optimizer in hdo.sub_optimizers:
        for param, state in optimizer.state.items():
            orig = hdo.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != param.device:
                    state[key] = hdo.state[orig][key] = value.to(param.device)


_HybridDeviceOptimizer._update_fp32_params_by_new_state = restore_masters
_HybridDeviceOptimizer._move_new_state_to_right_device = state_to_param_devices
_HybridDeviceOptimizer._set_sub_optimizer_grads = _hybrid_set_grads(_HybridDeviceOptimizer._set_sub_optimizer_grads)
_HybridDeviceOptimizer._init_sub_optimizers = _hybrid_init(_HybridDeviceOptimizer._init_sub_optimizers)


def _weak_backward_post_hook(make: Any) -> Any:
    """megatron-core 0.16's DDP puts a hook on each parameter's gradient accumulator (a C++ autograd node that the DDP
    keeps in `grad_accs`) closing over the DDP itself: a cycle through C++ that Python's collector cannot see, so a
    model once wrapped was never freed, nor its gradient buffer or the fp32 masters megatron's optimizer hangs on its
    parameters (`main_param`); a second trainer in the same process (tests, benchmarks, a rebuilt trainer) ran beside
    the first one's memory. The hook now reaches the DDP through a weak proxy; the DDP, alive while the trainer is,
    still runs it the same."""

    def wrapped(self: Any, param: torch.nn.Parameter) -> Any:
        return make(weakref.proxy(self), param)

    return wrapped


_DistributedDataParallel._make_backward_post_hook = _weak_backward_post_hook(
    _DistributedDataParallel._make_backward_post_hook
)
