"""One rank of a megatron-core run on the CPU (gloo), started by tests/test_megatron.py under
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT:

    python mcore_worker.py model MODEL_DIR TP EP OUT_FILE [DEVICE]
        GPTModel with tensor parallel TP on the HF weights: the logits of the packed micro-batch of
        test_megatron.py, the gradient of a log-prob loss, and the weights and gradients gathered back to HF names.
    python mcore_worker.py train MODEL_DIR TP EP OUT_FILE DISTRIBUTED_OPTIMIZER [DEVICE [R3]]
        MegatronTrainer (fp32): compute_logprobs, one train_step (2 mini-batches), the full weights after it;
        R3=1: the batch carries routing records and algo.routing_replay is on. MCORE_PP in the environment: the
        number of pipeline stages (default 1); MCORE_VPP: megatron.virtual_pipeline (default 1); MCORE_CP: megatron.context_parallel (default 1); MCORE_RECOMPUTE=full or selective: train.activation_checkpointing
        with that megatron.recompute_granularity; MCORE_OFFLOAD: megatron.optimizer_offload_fraction
        (precision-aware when > 0; a GPU and the distributed optimizer).

Rank 0 saves what it got to OUT_FILE.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import megatron_cpu_shims  # noqa: E402

megatron_cpu_shims()

from test_megatron import LENGTHS, TRAIN_LENGTHS, loss_of, packed_batch, r3_batch  # noqa: E402
from test_train_fsdp import STEP_ALGO, STEP_CFG, make_batch  # noqa: E402

from miles_hpc.config import MegatronConfig  # noqa: E402
from miles_hpc.models import read_config  # noqa: E402
from miles_hpc.train import dist as tdist  # noqa: E402
from miles_hpc.train import megatron as mg  # noqa: E402


def model_run(model_dir: str, tp: int, ep: int, device: str = "cpu") -> dict:
    world = tdist.world_from_env(device=device)
    tdist.init_trainer_world(world)
    mg.init_model_parallel(tensor_parallel=tp, expert_parallel=ep)
    cfg = read_config(model_dir)
    model = mg.build_gpt(cfg)
    mg.load_hf_weights(model, cfg, model_dir)
    ddp = mg.wrap_ddp(model.to(world.device))
    mb = packed_batch(LENGTHS, world.device)
    logits = mg.packed_logits(ddp, mb, cfg.vocab_size)
    loss = loss_of(logits, mb)
    loss.backward()
    mg.finalize_grads(ddp)
    weights = {k: v.cpu().clone() for k, v in mg.full_hf_state(model, cfg)}
    grads = {k: v.cpu().clone() for k, v in mg.full_hf_state(model, cfg, grads=True)}
    return {"logits": logits.detach().cpu(), "loss": loss.detach().cpu(), "weights": weights, "grads": grads}


def train_run(model_dir: str, tp: int, ep: int, distributed_optimizer: bool, device: str, r3: bool = False) -> dict:
    world = tdist.world_from_env(device=device)
    tdist.init_trainer_world(world)
    offload = float(os.environ.get("MCORE_OFFLOAD", "0"))  # megatron.optimizer_offload_fraction (GPU only)
    recompute = os.environ.get("MCORE_RECOMPUTE", "")  # full / selective: train.activation_checkpointing
    mcfg = MegatronConfig(
        tensor_parallel=tp,
        expert_parallel=ep,
        distributed_optimizer=distributed_optimizer,
        pipeline_parallel=int(os.environ.get("MCORE_PP", "1")),
        virtual_pipeline=int(os.environ.get("MCORE_VPP", "1")),
        context_parallel=int(os.environ.get("MCORE_CP", "1")),
        optimizer_offload_fraction=offload,
        precision_aware_optimizer=offload > 0,
        recompute_granularity=recompute or "full",
    )
    indexer_loss = float(os.environ.get("MCORE_INDEXER_LOSS", "0"))  # train.indexer_loss_coef
    mode = os.environ.get("MCORE_INDEXER_MODE", "sparse")
    cfg = dataclasses.replace(
        STEP_CFG,
        mixed_precision=False,
        indexer_loss_coef=indexer_loss,
        indexer_loss=mode,
        activation_checkpointing=bool(recompute),
    )
    algo = dataclasses.replace(STEP_ALGO, routing_replay=r3)
    trainer = mg.MegatronTrainer(model_dir, cfg, algo, mcfg, device=world.device, seed=0)
    batch = r3_batch(trainer.config) if r3 else make_batch(TRAIN_LENGTHS)
    logprobs = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    weights = {k: v.cpu().clone() for k, v in trainer.state_for_sync()}
    sm, rank = trainer.shard_map(), trainer.rank
    mismatch = [
        n
        for n in sm.shapes
        if not sm.layout[n][rank].empty and not torch.equal(weights[n][sm.layout[n][rank].slices()], sm.local[n].cpu())
    ]
    return {
        "logprobs": logprobs,
        "metrics": metrics,
        "weights": weights,
        "step": trainer.step,
        "shard_map_mismatch": mismatch,
        "recompute": trainer.model.module.config.recompute_granularity,
        "elements": _elements([chunk.module for chunk in trainer.chunks]),
    }


def _elements(chunks: list[torch.nn.Module]) -> dict[str, int]:
    """This rank's parameter elements over its model chunks, trained and frozen (GLM's router bias, a buffer, counts
    as its rule does: trained in a decoder layer, frozen in an MTP layer)."""
    from miles_hpc.planner.mcore_layout import is_frozen

    params = [p for m in chunks for p in m.parameters()]
    buffers = [(n, b) for m in chunks for n, b in m.named_buffers()]
    bias = [(is_frozen(n), b.numel()) for n, b in buffers if n.endswith("router.expert_bias")]
    return {
        "trained": sum(p.numel() for p in params if p.requires_grad) + sum(n for f, n in bias if not f),
        "frozen": sum(p.numel() for p in params if not p.requires_grad) + sum(n for f, n in bias if f),
    }


def main(mode: str, model_dir: str, tp: str, ep: str, out: str, *extra: str) -> None:
    torch.set_num_threads(1)
    if mode == "model":
        result = model_run(model_dir, int(tp), int(ep), *extra)
    else:
        device = extra[1] if len(extra) > 1 else "cpu"
        result = train_run(model_dir, int(tp), int(ep), extra[0] == "1", device, extra[2:] == ("1",))
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)
    tdist.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
    tdist.leave(0)
