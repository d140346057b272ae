"""The calibrated weight-sync model (planner/sync_time.py) against Miles' published update times (planner/published.py).

CPU only, no processes: each case builds its model on the meta device once.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from miles_hpc.planner import published, sync_time
from miles_hpc.planner.accounting import ModelSpecError
from miles_hpc.planner.estimate import Cluster, estimate, load_model_config


@pytest.fixture(scope="module")
def recs() -> list[dict]:
    return published.rows()


def test_every_case_within_30_percent(recs: list[dict]) -> None:
    assert [r["case"] for r in recs] == [c.name for c in published.CASES]
    for r in recs:
        for path in ("broadcast", "p2p"):
            assert 0.7 <= r[path]["ratio"] <= 1.3, (r["case"], path, r[path]["ratio"])


def test_fitted_constants_are_what_the_fit_gives() -> None:
    # The constants in sync_time are the fits on the named cases (rounded), not hand-tuned numbers.
    assert published.fit_mla_load_s() == pytest.approx(sync_time.MLA_LOAD_S, rel=0.02)
    assert published.fit_replica_gbps() == pytest.approx(sync_time.REPLICA_GBPS, rel=0.02)
    # the fits restore the module's constants
    assert sync_time.MLA_LOAD_S == 4.0e-4 and sync_time.REPLICA_GBPS == 262.0


def test_only_one_case_is_fitted_per_path(recs: list[dict]) -> None:
    for path in ("broadcast", "p2p"):
        assert sum(r[path]["fitted_here"] for r in recs) == 1


def test_output_schema(recs: list[dict]) -> None:
    keys = {"case", "model", "layout", "weights_gb", "broadcast", "p2p", "source", "script"}
    for r in recs:
        assert set(r) == keys
        json.dumps(r)  # one JSON line each
        for path in ("broadcast", "p2p"):
            assert {"predicted_s", "published_s", "ratio", "fitted_here", "terms"} <= set(r[path])
            assert r[path]["terms"]["seconds"] == r[path]["predicted_s"] > 0
        assert {"train", "engines", "gpus_per_node", "link_gbits", "rollout_dtype", "bucket_gb"} == set(r["layout"])
    table = published.format_rows(recs)
    assert table.count("\n") == len(recs) + 1 and "fitted" in table


def _times(case: published.Case) -> tuple[float, float]:
    cfg, _ = load_model_config(case.model)
    m = sync_time.model(cfg, case.layout)
    return m["broadcast"]["seconds"], m["p2p"]["seconds"]


def test_predictions_move_the_right_way() -> None:
    qwen = published.CASES[0]
    bc, p2p = _times(qwen)
    more_engines = _times(published.with_layout(qwen, engines=4))
    assert more_engines[0] > bc and more_engines[1] > p2p  # more ranks to drain, more targets per trainer rank
    slower = _times(published.with_layout(qwen, link_gbits=200.0))
    assert slower[0] > 1.8 * bc and slower[1] > p2p  # broadcast is wire-bound
    fp8 = _times(published.with_layout(qwen, rollout_bytes=1))
    assert fp8[0] < bc and fp8[1] < p2p
    smaller_buckets = _times(published.with_layout(qwen, bucket_gb=0.25))
    assert smaller_buckets[0] > bc
    more_trainers = _times(published.with_layout(qwen, train_gpus=128))
    assert more_trainers[1] < p2p  # fewer targets per trainer rank
    assert more_trainers[0] == pytest.approx(bc, rel=0.01)  # one source per stage whatever the trainer count


def test_mla_load_term_applies_to_mla_families_only() -> None:
    qwen_cfg, _ = load_model_config("qwen3_235b")
    glm_cfg, _ = load_model_config("glm5")
    assert sync_time.broadcast(qwen_cfg, published.CASES[0].layout)["engine_load_s"] == 0
    assert sync_time.broadcast(glm_cfg, published.CASES[1].layout)["engine_load_s"] > 0


def test_pipeline_stages_overlap_gather_with_broadcast() -> None:
    # one stage: nothing to hide the gather and conversion behind, so the update takes their sum
    cfg, _ = load_model_config("qwen3_235b")
    one = replace(published.CASES[0].layout, train_pp=1)
    b = sync_time.broadcast(cfg, one)
    assert b["seconds"] == pytest.approx(b["gather_s"] + b["convert_s"] + b["locked_s"])
    assert b["seconds"] > sync_time.broadcast(cfg, published.CASES[0].layout)["seconds"]


def test_layout_is_validated() -> None:
    with pytest.raises(ModelSpecError, match="train_tp x train_pp x train_cp"):
        sync_time.SyncLayout(train_gpus=64, train_tp=4, train_pp=4, train_cp=8)
    with pytest.raises(ModelSpecError, match="train_ep x train_pp"):
        sync_time.SyncLayout(train_gpus=64, train_pp=4, train_ep=32)
    with pytest.raises(ModelSpecError):
        Cluster(train_gpus=32, train_tp=3)


def test_estimate_shows_the_model() -> None:
    cfg, _ = load_model_config("qwen3_235b")
    c = Cluster(
        train_gpus=64,
        train_tp=4,
        train_pp=4,
        train_cp=2,
        train_ep=16,
        engines=2,
        engine_tp=32,
        engine_ep=32,
        engine_dp_attention=True,
        link_gbits=400.0,
        bucket_gb=published.GIB,
    )
    r = estimate(cfg, c)
    assert r["sync"]["broadcast"]["model"]["seconds"] == pytest.approx(_times(published.CASES[0])[0])
    assert r["sync"]["p2p"]["model"]["seconds"] == pytest.approx(_times(published.CASES[0])[1])
    # the wire lower bounds stay as they were
    assert r["sync"]["broadcast"]["seconds"] < r["sync"]["broadcast"]["model"]["seconds"]
    assert r["cluster"]["train_layout"] == "TP4 PP4 CP2 EP16"
    assert any("as Miles runs it" in a for a in r["assumptions"])


def test_qwen3_235b_config_is_the_published_size() -> None:
    from miles_hpc.planner.estimate import param_counts

    cfg, _ = load_model_config("qwen3_235b")
    total, active = param_counts(cfg)
    assert round(total / 1e9) == 235 and round(active / 1e9) == 22
    glm, _ = load_model_config("glm5")
    assert round(param_counts(glm)[0] / 1e9) == 754  # 744B + the MTP layer's 10B
