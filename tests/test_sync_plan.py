"""planner/transfer.py: the p2p weight-sync plan (pure; no process groups).

The property tests build random models, trainer world sizes and engine layouts, then *execute* the plan on CPU
tensors: each trainer rank's shard is cut from a random global tensor, every transfer copies ``shard[src_box]``
into ``local[dst_box]`` of the destination, and each engine rank's local tensor must equal the slice it needs, with
every element written exactly once.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles_hpc.planner.transfer import (
    Box,
    EngineRank,
    PlanError,
    SplitRule,
    Transfer,
    engine_layout,
    fsdp_layout,
    group_rank,
    link_bytes,
    per_rank_ops,
    plan_transfers,
    recvs_of,
    sends_of,
    summarize,
)


def rows(*spans: tuple[int, int], cols: int) -> tuple[Box, ...]:
    return tuple(Box(((lo, hi), (0, cols))) for lo, hi in spans)


def execute(shapes, trainer, engine, plan, seed=0):
    """Run ``plan`` on random tensors; check contents and that every needed element is written exactly once."""
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    local = {(n, d): torch.zeros(b.shape) for n, need in engine.items() for d, b in need.items()}
    hits = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in local.items()}
    for t in plan:
        held, need = trainer[t.name][t.src_rank], engine[t.name][t.dst]
        assert Box.full(held.shape).contains(t.src_box), t
        assert Box.full(need.shape).contains(t.dst_box), t
        assert t.src_box.shape == t.dst_box.shape == t.global_box.shape and not t.global_box.empty
        assert t.nbytes == t.global_box.numel * 4
        shard = full[t.name][held.slices()]  # what the source rank holds, in its local coordinates
        local[(t.name, t.dst)][t.dst_box.slices()] = shard[t.src_box.slices()]
        hits[(t.name, t.dst)][t.dst_box.slices()] += 1
    for (name, dst), got in local.items():
        assert torch.equal(got, full[name][engine[name][dst].slices()]), (name, dst)
        assert bool((hits[(name, dst)] == 1).all()), (name, dst)


# --- Box ---------------------------------------------------------------------------------------------------------


def test_box_helpers():
    a, b = Box(((0, 4), (2, 6))), Box(((3, 8), (0, 3)))
    assert a.intersect(b) == Box(((3, 4), (2, 3)))
    assert a.intersect(Box(((4, 8), (0, 6)))) is None  # touching is empty
    assert a.shape == (4, 4) and a.numel == 16 and not a.empty and Box(((5, 5), (0, 3))).empty
    assert Box(((3, 4), (2, 3))).relative_to(a) == Box(((3, 4), (0, 1)))
    assert Box.full((2, 3)).slices() == (slice(0, 2), slice(0, 3))
    assert Box(()).numel == 1  # a scalar
    with pytest.raises(ValueError, match="not inside"):
        b.relative_to(a)
    with pytest.raises(ValueError, match="bad box"):
        Box(((3, 2),))


# --- the worked example: a [6, 4] tensor, FSDP world 4, tp 2, one replica, 2-byte elements ----------------------


def test_worked_example_fsdp_shards():
    layout = fsdp_layout({"w": (6, 4)}, 4)
    assert layout["w"] == rows((0, 2), (2, 4), (4, 6), (6, 6), cols=4)  # rank 3 holds nothing


def test_worked_example_row_parallel():
    name = "model.layers.0.self_attn.o_proj.weight"  # row parallel: engine ranks need columns [0:2] and [2:4]
    shapes = {name: (6, 4)}
    engine = engine_layout(shapes, tp_size=2, replicas=1)
    e0, e1 = EngineRank(0, 0), EngineRank(0, 1)
    assert engine[name] == {e0: Box(((0, 6), (0, 2))), e1: Box(((0, 6), (2, 4)))}
    plan = plan_transfers(shapes, fsdp_layout(shapes, 4), engine, 2)
    got = [(t.src_rank, t.dst.rank, t.src_box.dims, t.dst_box.dims, t.nbytes) for t in plan]
    assert got == [
        (0, 0, ((0, 2), (0, 2)), ((0, 2), (0, 2)), 8),
        (1, 0, ((0, 2), (0, 2)), ((2, 4), (0, 2)), 8),
        (2, 0, ((0, 2), (0, 2)), ((4, 6), (0, 2)), 8),
        (0, 1, ((0, 2), (2, 4)), ((0, 2), (0, 2)), 8),
        (1, 1, ((0, 2), (2, 4)), ((2, 4), (0, 2)), 8),
        (2, 1, ((0, 2), (2, 4)), ((4, 6), (0, 2)), 8),
    ]
    s = summarize(plan)
    assert s.total_bytes == 6 * 4 * 2 and s.transfers == 6
    assert s.send_bytes == {0: 16, 1: 16, 2: 16} and s.max_send_bytes == 16  # rank 3 (empty) sends nothing
    assert s.recv_bytes == {e0: 24, e1: 24} and s.max_recv_bytes == 24
    assert link_bytes(plan) == {(r, e): 8 for r in range(3) for e in (e0, e1)}


def test_worked_example_column_parallel():
    name = "model.layers.0.self_attn.q_proj.weight"  # column parallel: rows [0:3] and [3:6]; FSDP cuts at 2 and 4
    shapes = {name: (6, 4)}
    plan = plan_transfers(shapes, fsdp_layout(shapes, 4), engine_layout(shapes, tp_size=2, replicas=1), 2)
    got = [(t.src_rank, t.dst.rank, t.global_box.dims[0], t.src_box.dims[0], t.dst_box.dims[0]) for t in plan]
    assert got == [
        (0, 0, (0, 2), (0, 2), (0, 2)),
        (1, 0, (2, 3), (0, 1), (2, 3)),
        (1, 1, (3, 4), (1, 2), (0, 1)),
        (2, 1, (4, 6), (0, 2), (1, 3)),
    ]
    assert all(t.src_box.dims[1] == t.dst_box.dims[1] == (0, 4) for t in plan)
    assert [t.nbytes for t in plan] == [16, 8, 8, 16]


# --- layouts -----------------------------------------------------------------------------------------------------


def test_fsdp_uneven_and_empty_shards():
    layout = fsdp_layout({"a": (5, 3), "b": (2, 3), "c": (7,), "d": (8, 3)}, 4)
    assert layout["d"] == rows((0, 2), (2, 4), (4, 6), (6, 8), cols=3)
    assert layout["a"] == rows((0, 2), (2, 4), (4, 5), (5, 5), cols=3)
    assert layout["b"] == rows((0, 1), (1, 2), (2, 2), (2, 2), cols=3)
    assert [b.dims for b in layout["c"]] == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 7),)]
    same = fsdp_layout({"x": (5, 3), "y": (5, 3)}, 4)
    assert same["x"] is same["y"]  # one tuple per shape: plan_transfers checks it once
    plan = plan_transfers({"b": (2, 3)}, {"b": layout["b"]}, engine_layout({"b": (2, 3)}, 2, 2), 4)
    assert {t.src_rank for t in plan} == {0, 1}
    with pytest.raises(PlanError, match="scalar_thing"):
        fsdp_layout({"scalar_thing": ()}, 2)


def test_vocab_parallel_split_and_errors():
    shapes = {"lm_head.weight": (10, 8)}

    def spans(layout):
        return [b.dims[0] for _, b in sorted(layout["lm_head.weight"].items())]

    assert spans(engine_layout(shapes, 4, 1)) == [(0, 3), (3, 6), (6, 9), (9, 10)]  # chunk semantics
    assert spans(engine_layout(shapes, 4, 1, vocab_pad_to=8)) == [(0, 4), (4, 8), (8, 10)]  # rank 3 needs nothing
    assert spans(engine_layout({"lm_head.weight": (12, 8)}, 4, 1, strict=True)) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(PlanError, match=r"lm_head\.weight.*vocab dim 10.*tp_size 4"):
        engine_layout(shapes, 4, 1, strict=True)


def test_column_row_not_divisible_names_tensor():
    with pytest.raises(PlanError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*3 column-parallel"):
        engine_layout({"model.layers.2.mlp.up_proj.weight": (10, 4)}, 3, 1)
    with pytest.raises(PlanError, match=r"model\.layers\.2\.mlp\.down_proj\.weight.*2 row-parallel"):
        engine_layout({"model.layers.2.mlp.down_proj.weight": (4, 5)}, 2, 1)


def test_strict_unmatched_and_default_replication():
    shapes = {"model.layers.0.input_layernorm.weight": (8,), "model.layers.0.mystery": (4, 4)}
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mystery: no split rule"):
        engine_layout(shapes, 2, 1, strict=True)
    layout = engine_layout(shapes, 2, 2)
    for name, shape in shapes.items():
        assert layout[name] == {EngineRank(e, r): Box.full(shape) for e in range(2) for r in range(2)}
    custom = (SplitRule(pattern=r"mystery$", kind="column"), SplitRule(pattern=r".", kind="replicated"))
    assert engine_layout(shapes, 2, 1, rules=custom, strict=True)["model.layers.0.mystery"][EngineRank(0, 1)] == Box(
        ((2, 4), (0, 4))
    )


def test_kv_heads_replicated_when_fewer_than_tp():
    name = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads of head_dim 4
    layout = engine_layout({name: (8, 16)}, 4, 1, kv_heads=2)
    assert [layout[name][EngineRank(0, r)].dims[0] for r in range(4)] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    assert engine_layout({name: (8, 16)}, 4, 1)[name][EngineRank(0, 3)].dims[0] == (6, 8)  # plain column split
    assert engine_layout({name: (16, 16)}, 2, 1, kv_heads=4)[name][EngineRank(0, 1)].dims[0] == (8, 16)
    with pytest.raises(PlanError, match=r"k_proj\.weight: 3 KV heads"):
        engine_layout({name: (12, 16)}, 2, 1, kv_heads=3)  # SGLang cannot split 3 heads over 2 ranks either


def test_expert_parallel_rule():
    up = "model.layers.0.mlp.experts.{}.up_proj.weight"
    down = "model.layers.0.mlp.experts.{}.down_proj.weight"
    shapes = {f.format(e): (8, 6) if f is up else (6, 8) for e in range(4) for f in (up, down)}
    layout = engine_layout(shapes, 4, 2, ep_size=2)  # moe tp 2: experts 0-1 on ranks 0-1, 2-3 on ranks 2-3
    assert layout[up.format(0)] == {
        EngineRank(e, r): Box(((4 * r, 4 * r + 4), (0, 6))) for e in range(2) for r in range(2)
    }
    assert set(layout[up.format(1)]) == {EngineRank(e, r) for e in range(2) for r in (0, 1)}  # contiguous blocks
    assert layout[down.format(3)] == {
        EngineRank(e, r): Box(((0, 6), (4 * (r - 2), 4 * (r - 2) + 4))) for e in range(2) for r in (2, 3)
    }
    whole = engine_layout(shapes, 4, 1, ep_size=4)  # one whole expert per rank
    assert all(whole[up.format(e)] == {EngineRank(0, e): Box.full((8, 6))} for e in range(4))
    rr = engine_layout(shapes, 4, 1, ep_size=4, expert_owner=lambda e, n, ep: (e + 1) % ep)
    assert rr[down.format(3)] == {EngineRank(0, 0): Box.full((6, 8))}
    with pytest.raises(PlanError, match=r"experts\.0\.up_proj.*3 experts"):
        engine_layout({up.format(e): (8, 6) for e in range(3)}, 2, 1, ep_size=2)
    trainer = fsdp_layout(shapes, 3)
    execute(shapes, trainer, layout, plan_transfers(shapes, trainer, layout, 4))


# --- plan --------------------------------------------------------------------------------------------------------


def test_identical_holders_share_the_sends():
    """Megatron-style copies: ranks 0-1 both hold the norm and rows 0-2 of ``w``, ranks 2-3 rows 2-4."""
    shapes = {"model.norm.weight": (8,), "w": (4, 4)}
    empty = Box(((0, 0),))
    trainer = {
        "model.norm.weight": (Box.full((8,)),) * 2 + (empty,) * 2,
        "w": rows((0, 2), (0, 2), (2, 4), (2, 4), cols=4),
    }
    engine = engine_layout(shapes, 2, 2)
    plan = plan_transfers(shapes, trainer, engine, 4)
    execute(shapes, trainer, engine, plan)
    # Destinations (0,0) (0,1) (1,0) (1,1): holder (replica + rank + box index) mod 2.
    assert [t.src_rank for t in plan if t.name == "model.norm.weight"] == [0, 1, 1, 0]
    assert [t.src_rank for t in plan if t.name == "w"] == [0, 3, 1, 2, 1, 2, 0, 3]
    # ``w`` is replicated on 4 engine ranks: each holder of a half sends it twice (2 x 32 B), plus the norm twice.
    assert summarize(plan).send_bytes == {0: 64 + 64, 1: 64 + 64, 2: 64, 3: 64}
    assert all(plan_transfers(shapes, trainer, engine, 4, only=r) == sends_of(plan, r) for r in range(4))


def test_bad_trainer_layouts_name_the_tensor():
    shapes = {"w": (4, 4)}
    engine = engine_layout(shapes, 1, 1)
    with pytest.raises(PlanError, match=r"w: trainer ranks \(0,\) and \(1,\) hold partly overlapping"):
        plan_transfers(shapes, {"w": rows((0, 3), (2, 4), cols=4)}, engine, 2)
    with pytest.raises(PlanError, match="w: trainer ranks hold 8 of its 16 elements"):
        plan_transfers(shapes, {"w": rows((0, 2), (2, 2), cols=4)}, engine, 2)
    with pytest.raises(PlanError, match="w: trainer rank 1 holds"):
        plan_transfers(shapes, {"w": rows((0, 2), (2, 5), cols=4)}, engine, 2)
    with pytest.raises(PlanError, match="w: no trainer layout"):
        plan_transfers(shapes, {}, engine, 2)
    with pytest.raises(PlanError, match="ghost: engines need it"):
        plan_transfers(shapes, fsdp_layout(shapes, 2), {**engine, "ghost": {}}, 2)


def random_model(rng: random.Random, tp: int, ep: int, *, split_only: bool) -> dict[str, tuple[int, ...]]:
    """A small random model with every kind of tensor; sizes divisible where the kind requires it."""
    h, f, v = tp * rng.randint(1, 4), tp * rng.randint(1, 5), rng.randint(1, 23)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(rng.randint(1, 2)):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (h, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if not split_only:
            shapes |= {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.bias": (h,),
                p + "mlp.gate.weight": (4, h),
            }
        for e in range(ep * rng.randint(1, 2)):
            shapes |= {p + f"mlp.experts.{e}.gate_proj.weight": (f, h), p + f"mlp.experts.{e}.down_proj.weight": (h, f)}
    shapes["lm_head.weight"] = (v, h)
    return shapes


@pytest.mark.parametrize("seed", range(40))
def test_plan_property(seed: int):
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4])
    ep, world, replicas = rng.choice([d for d in (1, 2, 4) if tp % d == 0]), rng.randint(1, 9), rng.randint(1, 3)
    split_only = seed % 2 == 0
    shapes = random_model(rng, tp, ep, split_only=split_only)
    trainer = fsdp_layout(shapes, world)
    kv_heads = None if split_only else rng.choice([None, 1, tp])  # 1: every rank needs the one KV head
    engine = engine_layout(shapes, tp, replicas, ep_size=ep, vocab_pad_to=rng.choice([1, 8]), kv_heads=kv_heads)
    plan = plan_transfers(shapes, trainer, engine, 4)
    execute(shapes, trainer, engine, plan, seed)

    shard = {r: sum(trainer[n][r].numel * 4 for n in shapes) for r in range(world)}
    sent = summarize(plan).send_bytes
    for r in range(world):  # the p2p bound: shard bytes x replicas (x tp for the replicated tensors)
        assert sent.get(r, 0) <= shard[r] * replicas * (1 if split_only else tp)
    if split_only:  # every held element goes exactly once to each replica
        assert sum(sent.values()) == sum(shard.values()) * replicas

    assert plan == plan_transfers(dict(shapes), trainer, {n: dict(reversed(d.items())) for n, d in engine.items()}, 4)
    order = {n: i for i, n in enumerate(shapes)}
    keys = [(order[t.name], t.dst, t.src_rank) for t in plan]
    assert keys == sorted(keys)
    assert sum(len(sends_of(plan, r)) for r in range(world)) == len(plan)
    dsts = {t.dst for t in plan}
    assert sum(len(recvs_of(plan, d)) for d in dsts) == len(plan)
    for r in {0, world - 1}:
        assert plan_transfers(shapes, trainer, engine, 4, only=r) == per_rank_ops(plan, r) == sends_of(plan, r)
    for d in [min(dsts), max(dsts), EngineRank(replicas, 0)]:  # the last needs nothing
        assert plan_transfers(shapes, trainer, engine, 4, only=d) == per_rank_ops(plan, d) == recvs_of(plan, d)


def test_pairing_order_between_two_peers():
    """Both sides filter the same list, so the k-th send from s to d is the k-th receive at d from s."""
    shapes = random_model(random.Random(7), 2, 1, split_only=False)
    plan = plan_transfers(shapes, fsdp_layout(shapes, 3), engine_layout(shapes, 2, 2), 2)
    for s in range(3):
        for d in {t.dst for t in plan}:
            assert [t for t in sends_of(plan, s) if t.dst == d] == [t for t in recvs_of(plan, d) if t.src_rank == s]


def test_group_rank_and_dtype_map():
    assert [group_rank(r, world=4, tp_size=2) for r in (0, 3, EngineRank(0, 0), EngineRank(1, 1))] == [0, 3, 4, 7]
    shapes = {"model.norm.weight": (4,), "lm_head.weight": (4, 2)}
    plan = plan_transfers(
        shapes, fsdp_layout(shapes, 1), engine_layout(shapes, 1, 1), {"model.norm.weight": 4, "lm_head.weight": 2}
    )
    assert [(t.name, t.nbytes) for t in plan] == [("model.norm.weight", 16), ("lm_head.weight", 16)]
    assert isinstance(plan[0], Transfer)
