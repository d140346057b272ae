"""`mcore_checkpoint.fix_group_order`: megatron-core's distributed optimizer records each model parameter's place in
its parameter group with its own `_build_optimizer_group_ranges` (run here, the real code), while the group it
builds holds [float32 parameters, fp32 copies of the 16-bit ones] (`_build_model_and_main_param_groups`, CUDA only:
its order is restated here). A bf16 model with float32 norms mixes both kinds in one group: megatron's places then
name other parameters (its save failed on the H200 on a size mismatch), the fixed ones name each parameter's own."""

from __future__ import annotations

import importlib
import importlib.util
import types

import torch
from conftest import has_megatron, require


def _layout(dtypes: list[torch.dtype]) -> tuple[types.SimpleNamespace, list[torch.nn.Parameter], list[list]]:
    require(has_megatron(), "megatron-core (the megatron extra)")
    mod = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    params = [torch.nn.Parameter(torch.zeros(i + 1, dtype=d)) for i, d in enumerate(dtypes)]
    param_groups = [{"params": params[:3]}, {"params": params[3:]}]
    # One grad buffer per dtype, one bucket each, as megatron's DDP groups parameters by dtype.
    gbuf_ranges = [
        {d: [{"param_map": {p: None for p in params if p.dtype == d}}]} for d in sorted(set(dtypes), key=str)
    ]
    index_map, group_ranges = mod.DistributedOptimizer._build_optimizer_group_ranges(param_groups, gbuf_ranges)
    # What megatron's optimizer groups hold, per group: the float32 parameters first, then the 16-bit ones.
    groups = []
    for g in group_ranges:
        fp32 = [p for p in g["params"] if p.dtype == torch.float32]
        groups.append(fp32 + [p for p in g["params"] if p.dtype != torch.float32])
    sub = types.SimpleNamespace(model_param_group_index_map=index_map, opt_group_ranges=group_ranges)
    return sub, params, groups


def test_mixed_groups_get_each_parameter_its_own_place() -> None:
    from miles_hpc.train.mcore_checkpoint import fix_group_order

    sub, params, groups = _layout([torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16])
    places = sub.model_param_group_index_map
    wrong = [p for p in params if groups[places[p][0]][places[p][1]] is not p]
    assert wrong, "megatron's own places name other parameters in a mixed group (the bug this fixes)"
    fix_group_order(types.SimpleNamespace(chained_optimizers=[sub, object()]))
    for p in params:
        g, order = sub.model_param_group_index_map[p]
        assert groups[g][order] is p


def test_groups_of_one_kind_keep_megatron_places() -> None:
    from miles_hpc.train.mcore_checkpoint import fix_group_order

    sub, params, _ = _layout([torch.bfloat16] * 5)
    before = dict(sub.model_param_group_index_map)
    fix_group_order(sub)
    assert sub.model_param_group_index_map == before
