"""`train/mcore_fixes.py`'s fixes to megatron-core 0.16. `gpu_share_grads`: megatron-core 0.16's CPU-offload optimizer (HybridDeviceOptimizer) steps the share it
keeps on the GPU with torch's AdamW, which reads `.grad`, while the precision-aware distributed optimizer leaves the
gradients in `.decoupled_grad`. Its GPU half is CUDA-only (streams, `is_cuda` splits, pinned copies); here the fix is
run on the objects it reads, stated as megatron builds them: its GPU sub-optimizer over float32 parameters kept as
they are and float32 copies of 16-bit ones (`fp32_param_to_orig_param`). The GPU check of the whole step is
`tests/test_megatron.py::test_offloaded_optimizer_steps_like_fsdp_gpu`. And a dropped megatron trainer is freed
(megatron's DDP hooks kept it alive)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import has_megatron, require
from test_train_fsdp import free_port


def _fix() -> types.ModuleType:
    require(has_megatron(), "megatron-core (the megatron extra)")
    return importlib.import_module("miles_hpc.train.mcore_fixes")


def test_float32_parameters_kept_on_the_gpu_step() -> None:
    fixes = _fix()
    kept = torch.zeros(4)  # a float32 parameter the optimizer keeps on the GPU: its gradient only in decoupled_grad
    kept.decoupled_grad = torch.ones(4)
    copy = torch.zeros(3)  # the float32 copy of a bf16 parameter: megatron fills its .grad itself
    copy.grad = torch.full((3,), 2.0)
    frozen = torch.zeros(2)  # no gradient this step
    gpu = torch.optim.AdamW([kept, copy, frozen], lr=0.1, weight_decay=0.0)
    hdo = types.SimpleNamespace(
        gpu_optimizer=gpu, fp32_param_to_orig_param={copy: torch.zeros(3, dtype=torch.bfloat16)}
    )
    fixes.gpu_share_grads(hdo)
    assert kept.grad is kept.decoupled_grad
    assert torch.equal(copy.grad, torch.full((3,), 2.0))
    assert frozen.grad is None
    gpu.step()
    # Adam's first step moves every parameter with a gradient by lr against its sign; one without stays.
    torch.testing.assert_close(kept, torch.full((4,), -0.1))
    torch.testing.assert_close(copy, torch.full((3,), -0.1))
    assert torch.equal(frozen, torch.zeros(2))


def test_without_a_gpu_share_nothing_is_touched() -> None:
    fixes = _fix()
    fixes.gpu_share_grads(types.SimpleNamespace(gpu_optimizer=None, fp32_param_to_orig_param={}))


def test_loaded_masters_reach_what_each_sub_optimizer_steps() -> None:
    """After a state load megatron writes each loaded master into the float32 copy of a 16-bit parameter; the fix
    also takes a float32 parameter kept on the GPU (its own master: no copy, megatron raised KeyError there) and a
    float32 parameter offloaded (its host copy)."""
    fixes = _fix()
    bf16, kept, offloaded = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2), torch.zeros(4)
    copy16, host = torch.zeros(3), torch.zeros(4)
    masters = {bf16: torch.full((3,), 1.5), kept: torch.full((2,), 2.5), offloaded: torch.full((4,), 3.5)}
    hdo = types.SimpleNamespace(
        param_update_in_fp32=True,
        state={p: {"master_param": m, "exp_avg": torch.ones_like(m)} for p, m in masters.items()},
        param_to_inner_param={bf16: copy16, kept: kept, offloaded: host},
    )
    fixes.restore_masters(hdo)
    for inner, p in ((copy16, bf16), (kept, kept), (host, offloaded)):
        assert torch.equal(inner, masters[p])
    assert torch.equal(bf16, torch.zeros(3, dtype=torch.bfloat16))  # the 16-bit weights come from the model's load


def test_loaded_state_goes_to_the_device_of_what_each_sub_optimizer_steps() -> None:
    """After a state load megatron moved a sub-optimizer's state to the host when it was an instance of the CPU
    optimizer's class: without Transformer Engine both are torch's AdamW, so the GPU share's moments went to the host
    too. Here the GPU share is stood in by the meta device (no GPU on CI): its moments and step follow its
    parameter there, the host share's stay on the host."""
    fixes = _fix()
    host, kept = torch.zeros(3), torch.zeros(2, device="meta")
    cpu_opt, gpu_opt = torch.optim.AdamW([host]), torch.optim.AdamW([kept])  # the classes megatron picks without TE
    orig_host, orig_kept = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    loaded = {p: {"step": torch.tensor(2.0), "exp_avg": torch.ones(n)} for p, n in ((orig_host, 3), (orig_kept, 2))}
    cpu_opt.state = {host: loaded[orig_host]}  # as megatron's _sync_hdo_state_to_sub_optimizers shares them
    gpu_opt.state = {kept: loaded[orig_kept]}
    hdo = types.SimpleNamespace(
        sub_optimizers=[cpu_opt, gpu_opt],
        inner_param_to_orig_param={host: orig_host, kept: orig_kept},
        state=loaded,
        defaults={"cpu_optimizer_cls": torch.optim.AdamW},
    )
    fixes.state_to_param_devices(hdo)
    assert {v.device.type for v in loaded[orig_kept].values()} == {"meta"}
    assert {v.device.type for v in loaded[orig_host].values()} == {"cpu"}
    assert gpu_opt.state[kept] is loaded[orig_kept]


def test_megatron_optimizer_is_patched() -> None:
    """Importing the fixes wraps the two methods of megatron's class the fix needs (its step reads them) and
    replaces the two a state load calls."""
    fixes = _fix()
    hdo = importlib.import_module("megatron.core.optimizer.cpu_offloading.hybrid_optimizer").HybridDeviceOptimizer
    assert hdo._set_sub_optimizer_grads.__qualname__.startswith(fixes._hybrid_set_grads.__qualname__)
    assert hdo._init_sub_optimizers.__qualname__.startswith(fixes._hybrid_init.__qualname__)
    assert hdo._update_fp32_params_by_new_state is fixes.restore_masters
    assert hdo._move_new_state_to_right_device is fixes.state_to_param_devices


FREED = r"""
import gc, os, sys, weakref
from pathlib import Path
import torch
from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.models.presets import init_model
from miles_hpc.train import dist as tdist
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.megatron import MegatronTrainer

torch.set_num_threads(1)
tdist.init_trainer_world(tdist.world_from_env(device="cpu"))
model = init_model("qwen3_moe", "tiny", Path(sys.argv[1]))
toks = [list(range(3, 19)), list(range(5, 15))]
batch = TrainBatch(
    tokens=toks,
    loss_mask=[[0] * 4 + [1] * (len(t) - 4) for t in toks],
    rollout_logprobs=[[-1.0] * len(t) for t in toks],
    advantages=[[1.0] * len(t) for t in toks],
    token_hash=[token_hash(t) for t in toks],
)
trainer = MegatronTrainer(model, TrainConfig(), AlgoConfig(), MegatronConfig(distributed_optimizer=False), device="cpu", seed=0)
trainer.train_step(batch)
alive = [weakref.ref(trainer.model), weakref.ref(next(trainer.model.parameters()))]
del trainer
gc.collect()
print("alive", [r() is not None for r in alive])
"""


@pytest.mark.process
def test_a_dropped_trainer_frees_its_model(tmp_path: Path) -> None:
    """The DDP's hooks on the gradient accumulators reach it weakly: once the trainer is dropped its model (and the
    gradient buffer and masters hanging on it) is freed; before, a second trainer in one process ran beside the
    first one's memory (bench_megatron_memory's offloaded step measured the GPU trainer's leftovers)."""
    _fix()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run(
        [sys.executable, "-c", FREED, str(tmp_path / "model")], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "alive [False, False]" in out.stdout, out.stdout
