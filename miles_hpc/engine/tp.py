"""The tensor-parallel embedded engine: N ranks, one HTTP front (rank 0), each rank a shard of the model.

Stage: engine. `miles-hpc serve --tp-size N` (EngineConfig.tp_size) makes the serving process rank 0: it runs the
HTTP server, the scheduler and the KV-cache bookkeeping, and starts ranks 1..N-1 as processes of their own
(`python -m miles_hpc.engine.tp`, on device index base + rank). Every rank holds its part of every HF tensor
(tp_layout.py: `planner.transfer.engine_layout`'s boxes) and a cache of its own heads (MLA: the latent every head
shares, whole on each rank). Per step rank 0 sends the step's `StepInputs` and all ranks run the same forward:
partial outputs of row-parallel layers (o_proj, down_proj, the experts) are summed (all-reduce), the embedding is
looked up by vocabulary block and summed, the LM head's vocabulary blocks are gathered, so rank 0 samples from the
whole logits and reports log-probs over the whole vocabulary. Routers, norms and the DSA indexer are replicated and
see the same (summed) inputs on every rank, so every rank routes and selects alike.

Wire: a gloo group over the ranks for control (pickle-free: `torch.save` / `torch.load(weights_only=True)` of
plain values and tensors), and a second group for the model's collectives: gloo on CPU, NCCL/RCCL on GPUs
(`sync/wire/pg.py`'s CustomGroup: no default process group, so a weight-update group can coexist). Two groups on
CPU too: joining or destroying a weight-update group sends its message without the step lock, during a forward.

Invariants:
- Messages go out only from rank 0, one at a time (the driver's lock), and every rank handles them in order; those
  that run collectives on the model's weights (a step, a weight update, a gather) go out under the engine's step
  lock, between steps.
- Weight updates arrive whole at rank 0 (disk, tensor, delta routes) and are broadcast; each rank keeps its box. A
  delta is decoded on rank 0 against the whole tensors gathered from the ranks (the codec's classes span the whole
  tensor), then broadcast as any whole tensor.
- A rank that dies takes the engine down: rank 0's next collective fails (the run's supervisor restarts the
  engine); ranks die with rank 0 (`cluster.lease.watch_parent`) and when it stops them.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles_hpc.faults import crash_point
from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors, read_config
from miles_hpc.models.moe import Experts
from miles_hpc.models.transformer import DecoderModel
from miles_hpc.planner.transfer import Box
from miles_hpc.sync.wire.pg import CustomGroup, GroupSpec

from . import tp_layout
from .config import DTYPES, EngineConfig
from .validate import RequestError
from .weights import apply_named, iter_checkpoint

__all__ = ["TPComm", "TPDriver", "TPShard", "launch_workers", "start_tp"]

log = logging.getLogger(__name__)
_MAX_TIMEOUT_S = 7 * 24 * 3600.0  # an idle engine waits for requests for days; rank 0's death ends the wait


@dataclass(frozen=True, kw_only=True, slots=True)
class TPSpec:
    tp_size: int
    rank: int
    master_address: str
    master_port: int
    device: str  # this rank's torch device


class TPComm:
    """The ranks' two groups (module docstring) and the control messages."""

    def __init__(self, spec: TPSpec) -> None:
        def group(backend: str, name: str, port: int) -> CustomGroup:
            gspec = GroupSpec(
                backend=backend,  # type: ignore[arg-type]
                master_address=spec.master_address,
                master_port=port,
                rank=spec.rank,
                world_size=spec.tp_size,
                group_name=name,
                timeout_s=_MAX_TIMEOUT_S,
            )
            return CustomGroup(gspec, None if backend == "gloo" else spec.device)

        self.rank, self.size = spec.rank, spec.tp_size
        self.control = group("gloo", "engine_tp_control", spec.master_port)
        # A group of its own even on CPU: control calls that need no step lock (joining or destroying a
        # weight-update group, stop) may go out while a forward's collectives run, and gloo pairs the operations
        # of one group by order, so sharing it would mix a message into an all-reduce (wrong sizes, or a hang).
        on_gpu = torch.device(spec.device).type == "cuda"
        self.compute = group("nccl" if on_gpu else "gloo", "engine_tp", spec.master_port + 1)

    def send(self, message: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(message, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self.control.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0)
        self.control.broadcast(payload, src=0)

    def recv(self) -> dict[str, Any]:
        n = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(n, src=0)
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        self.control.broadcast(payload, src=0)
        out: dict[str, Any] = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        return out

    def all_reduce(self, t: torch.Tensor) -> None:
        self.compute.all_reduce(t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self.compute.all_gather(t)

    def destroy(self) -> None:
        self.compute.destroy()
        self.control.destroy()


class _VocabEmbedding(nn.Embedding):
    """This rank's block of vocabulary rows; other ids look up zeros, and the ranks' lookups are summed."""

    def __init__(self, rows: int, hidden: int, start: int, comm: TPComm) -> None:
        super().__init__(rows, hidden)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = torch.where(mine[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        self.comm.all_reduce(out)
        return out


class _GatheredHead(nn.Linear):
    """This rank's block of LM-head rows; the ranks' logits are gathered into the whole vocabulary."""

    def __init__(self, hidden: int, rows: int, vocab: int, comm: TPComm) -> None:
        super().__init__(hidden, rows, bias=False)
        self.vocab, self.comm = vocab, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.comm.all_gather(F.linear(x, self.weight)), dim=-1)[..., : self.vocab]


class TPShard:
    """What rank `rank` of `tp` holds: the full model's HF shapes, the layout, and the conversions."""

    def __init__(self, config: ModelConfig, tp: int, rank: int) -> None:
        self.config, self.tp, self.rank = config, tp, rank
        self.local_config = tp_layout.local_config(config, tp)
        with torch.device("meta"):
            self.full_meta = CausalLM(config)  # shapes and checkpoint checks only: no memory
        self.shapes = {n: tuple(t.shape) for n, t in iter_hf_tensors(self.full_meta)}
        self.layout = tp_layout.layout(config, self.shapes, tp)

    def box(self, name: str, rank: int | None = None) -> Box | None:
        return self.layout[name].get(self.rank if rank is None else rank)

    def local(self, name: str, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        r = self.rank if rank is None else rank
        box = self.box(name, r)
        shape = tp_layout.local_shape(tuple(full.shape), box, name, self.config, self.tp)
        if r and tp_layout.row_bias(name):
            return full.new_zeros(shape)
        return tp_layout.take(full, box, shape)

    def from_part(self, name: str, part: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The rank-local tensor of `name` from exactly its box of the whole tensor (what the resharded p2p
        delivers): the box at the start, zeros after it (a vocabulary block's padding), zeros for a row bias."""
        r = self.rank if rank is None else rank
        box = self.box(name, r)
        shape = tp_layout.local_shape(self.shapes[name], box, name, self.config, self.tp)
        if (box is not None and tuple(part.shape) != box.shape) or (box is None and part.numel()):
            raise RequestError(f"weight {name!r}: part of shape {tuple(part.shape)}, rank {r} holds {box}")
        if box is not None and box.shape == shape and not (r and tp_layout.row_bias(name)):
            return part
        out = part.new_zeros(shape)
        if box is not None and not (r and tp_layout.row_bias(name)):
            out[tuple(slice(0, n) for n in box.shape)] = part
        return out

    def apply_parts(self, model: CausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy this rank's parts (per-expert HF names, each exactly this rank's box) into its model."""
        return apply_named(model, ((n, self.from_part(n, t)) for n, t in named))

    def part_shape(self, name: str, rank: int | None = None) -> tuple[int, ...]:
        """The shape of rank `rank`'s box of tensor `name` (what it receives of it; (0,): nothing)."""
        box = self.box(name, rank)
        return (0,) if box is None else box.shape

    def build(self, comm: TPComm, device: torch.device, dtype: torch.dtype) -> CausalLM:
        """This rank's model (uninitialised weights), wired for the collectives."""
        c, lc = self.config, self.local_config
        with torch.device(device):
            model = CausalLM(lc).to(dtype)
            rows = lc.vocab_size
            emb = _VocabEmbedding(rows, c.hidden_size, self.rank * rows, comm).to(dtype)
            head = _GatheredHead(c.hidden_size, rows, c.vocab_size, comm).to(dtype)
        if not isinstance(model.model, DecoderModel):  # validate.py refuses hybrids at tp_size > 1 first
            raise ValueError(f"{c.model_type}: tensor-parallel engines shard decoder layers, not Nemotron-H blocks")
        model.model.embed_tokens, model.lm_head = emb, head
        model.tie_weights()
        for name, module in model.named_modules():
            if name.endswith((".o_proj", ".down_proj")) or isinstance(module, Experts):
                module.register_forward_hook(_summed(comm))
        return model.eval()

    def apply(self, model: CausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy this rank's part of each whole HF tensor into its model; returns the names applied."""
        parts = ((n, self.local(n, t)) for n, t in tp_layout.per_expert(self.config, named))
        return apply_named(model, parts)

    def check(self, name: str, value: object) -> None:
        """RequestError unless `value` is the whole tensor `name` of the full model (as apply_named checks at TP 1:
        nothing is sent to the other ranks before)."""
        if not isinstance(value, torch.Tensor):
            raise RequestError(f"weight {name!r}: expected a tensor, got {type(value).__name__}")
        if tp_layout.is_fused(name):
            return  # split per expert, each part checked by apply_named
        if name not in self.shapes and not (self.config.tie_word_embeddings and name == "lm_head.weight"):
            raise RequestError(f"weight {name!r}: no such tensor in this {self.config.model_type} model")
        if name in self.shapes and tuple(value.shape) != self.shapes[name]:
            raise RequestError(
                f"weight {name!r}: shape {tuple(value.shape)} does not match the model's {self.shapes[name]}"
            )

    def assemble(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The whole tensor `name` from every rank's local tensor (rank order); None when ranks holding the same
        elements (replicated tensors, shared KV heads) disagree, or a rank's padding or zero bias is not zero."""
        full = parts[0].new_zeros(self.shapes[name])
        seen = torch.zeros(self.shapes[name], dtype=torch.bool)
        for r, part in enumerate(parts):
            box = self.box(name, r)
            inside = tuple(slice(0, n) for n in box.shape) if box is not None else None
            rest = part.clone()
            if box is not None and inside is not None and not (r and tp_layout.row_bias(name)):
                mine, held = part[inside], seen[box.slices()]
                if bool(held.any()) and not torch.equal(full[box.slices()][held], mine[held]):
                    return None
                full[box.slices()] = mine
                seen[box.slices()] = True
                rest[inside] = 0
            if bool(rest.ne(0).any()):
                return None
        return full


def _summed(comm: TPComm) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(out)
        return out

    return hook


class TPDriver:
    """Rank 0's side: the other ranks' processes, and what it sends them (module docstring)."""

    def __init__(self, comm: TPComm, shard: TPShard, procs: list[subprocess.Popen[bytes]]) -> None:
        self.comm, self.shard, self.procs = comm, shard, procs
        self.vocab_size = shard.config.vocab_size
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def tp_size(self) -> int:
        return self.shard.tp

    def start_cache(self, **geometry: Any) -> None:
        """Tell the other ranks the cache rank 0 allocated (blocks, block size, dtype, what it records)."""
        with self._lock:
            self.comm.send({"op": "cache", **geometry})

    def step(self, inputs: Any) -> None:
        with self._lock:
            self._alive()
            self.comm.send({"op": "step", **_fields(inputs)})

    def apply(self, model: CausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """A weight update of whole HF tensors: each is checked, broadcast, and every rank keeps its box."""
        applied: list[str] = []
        with self._lock:
            self._alive()
            for name, value in named:
                self.shard.check(name, value)
                t = value.detach().to("cpu").contiguous()
                self.comm.send({"op": "tensor", "name": name, "shape": list(t.shape), "dtype": str(t.dtype)[6:]})
                self.comm.control.broadcast(t, src=0)
                applied += self.shard.apply(model, [(name, t)])
        return applied

    def join_group(self, spec: GroupSpec, join: Callable[[], Any]) -> Any:
        """Weight-update group `spec` (this engine's rank 0 at `spec.rank`): every other rank joins at
        `spec.rank + tp_rank` while `join()` joins rank 0 (SGLang's layout, `/init_weights_update_group`)."""
        with self._lock:
            self._alive()
            self.comm.send({"op": "join", **_fields(spec)})
            return join()

    def receive_group(self, group_name: str, names: Any, dtypes: Any, shapes: Any) -> None:
        """Tell the other ranks to receive the announced bucket from group `group_name` (rank 0 receives it next,
        between steps: the caller holds the engine's step lock)."""
        with self._lock:
            self._alive()
            bucket = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(x) for x in shapes]}
            self.comm.send({"op": "receive", "group_name": group_name, **bucket})

    def receive_parts(self, group_name: str, names: Any, dtypes: Any, tp_pieces: Any) -> None:
        """Tell the other ranks to receive their pieces of the announced bucket (the resharded p2p: each rank's
        own parts, straight from the trainer ranks); rank 0 receives its own next, between steps."""
        with self._lock:
            self._alive()
            self.comm.send(
                {"op": "p2p", "group_name": group_name, "names": list(names), "dtypes": list(dtypes),
                 "tp_pieces": [[[(src, [list(d) for d in dims]) for src, dims in ps] for ps in ranks]
                               for ranks in tp_pieces]}
            )  # fmt: skip

    def destroy_group(self, group_name: str) -> None:
        with self._lock:
            if self.dead_rank() is None:
                self.comm.send({"op": "destroy_group", "group_name": group_name})

    def gather(self, model: CausalLM, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) of the weights every rank holds now, in the Hub layout: every one, or those
        `names` lists (in the model's order; a name the model lacks is skipped)."""
        wanted = None if names is None else sorted(set(names))
        with self._lock:
            self._alive()
            self.comm.send({"op": "gather", "names": wanted})
            for name, t in _selected(model, wanted):
                parts = self.comm.control.all_gather(t.detach().to("cpu").contiguous())
                whole = self.shard.assemble(name, parts)
                if whole is None:  # no checksum can match: the ranks' copies differ
                    whole = torch.full((1,), float("nan"))
                yield name, whole

    def shutdown(self, grace_s: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            try:
                if all(p.poll() is None for p in self.procs):
                    self.comm.send({"op": "stop"})
            except Exception as e:  # a rank already gone: stop the rest below
                log.warning("stopping the tensor-parallel ranks: %s", e)
            for p in self.procs:
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            self.comm.destroy()

    def dead_rank(self) -> str | None:
        """Which other rank has exited, as a message (None: all alive)."""
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
        if not dead:
            return None
        rank, rc = dead[0]
        return f"tensor-parallel rank {rank} of this engine exited (code {rc}): the engine cannot serve"

    def watch(self, on_death: Callable[[str], None], interval_s: float = 0.5) -> None:
        """Call `on_death(message)` once, from a daemon thread, when another rank exits on its own (the server
        then shuts down: an engine missing a rank serves nothing, and its supervisor restarts the whole)."""

        def loop() -> None:
            while not self._stopping.wait(interval_s):
                msg = self.dead_rank()
                if msg is not None:
                    if not self._stopping.is_set():
                        log.error("%s", msg)
                        on_death(msg)
                    return

        threading.Thread(target=loop, name="engine-tp-watch", daemon=True).start()

    def _alive(self) -> None:
        msg = self.dead_rank()
        if msg is not None:
            raise RuntimeError(msg)


def _selected(model: CausalLM, names: list[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's HF tensors, or those `names` lists (the same order on every rank: the model's)."""
    keep = None if names is None else set(names)
    return ((n, t) for n, t in iter_hf_tensors(model) if keep is None or n in keep)


def _fields(inputs: Any) -> dict[str, Any]:
    return {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}


# ---------------------------------------------------------------------- starting the ranks
def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` places after the engine's own."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def free_port_pair(host: str) -> int:
    """A port p with p and p + 1 free on `host` (the two groups' stores)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind((host, p + 1))
            except OSError:
                continue
        return int(p)
    raise RuntimeError(f"no two adjacent free ports on {host}")


def launch_workers(
    path: str, tp: int, device: str, dtype: str | None, host: str = "127.0.0.1"
) -> tuple[TPComm, list[subprocess.Popen[bytes]]]:
    """Start ranks 1..tp-1 of an engine over checkpoint `path` and join them as rank 0."""
    port = free_port_pair(host)
    procs = []
    for rank in range(1, tp):
        argv = [sys.executable, "-m", "miles_hpc.engine.tp", "--model", str(path), "--tp-size", str(tp)]
        argv += ["--rank", str(rank), "--address", host, "--port", str(port), "--device", rank_device(device, rank)]
        if dtype is not None:
            argv += ["--dtype", dtype]
        env = dict(os.environ, MILES_PARENT_PID=str(os.getpid()))
        procs.append(subprocess.Popen(argv, env=env))
    try:
        comm = TPComm(TPSpec(tp_size=tp, rank=0, master_address=host, master_port=port, device=device))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return comm, procs


def load_rank(path: str, shard: TPShard, comm: TPComm, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """This rank's model with its part of the checkpoint at `path` (read whole, tensor by tensor, and sliced)."""
    model = shard.build(comm, device, dtype)
    shard.apply(model, iter_checkpoint(shard.full_meta, path))
    return model


def start_tp(path: str, config: EngineConfig) -> tuple[CausalLM, TPDriver]:
    """Rank 0 of a tensor-parallel engine over checkpoint `path`: its shard of the model, and the driver of the other
    ranks (started here, each loading its own shard)."""
    mc = read_config(path)
    shard = TPShard(mc, config.tp_size, 0)
    comm, procs = launch_workers(path, config.tp_size, config.device, config.dtype)
    driver = TPDriver(comm, shard, procs)
    try:
        dtype = config.torch_dtype() or mc.torch_dtype() or torch.float32
        model = load_rank(path, shard, comm, torch.device(config.device), dtype)
    except BaseException:
        driver.shutdown(grace_s=1.0)
        raise
    return model, driver


def _worker(argv: list[str]) -> int:
    from miles_hpc.cluster.lease import parent_pid_from_env, watch_parent

    from .latent_cache import make_cache
    from .runner import StepExecutor, StepInputs

    ap = argparse.ArgumentParser(prog="python -m miles_hpc.engine.tp")
    for flag in ("--model", "--address", "--device"):
        ap.add_argument(flag, required=True)
    for flag in ("--tp-size", "--rank", "--port"):
        ap.add_argument(flag, type=int, required=True)
    ap.add_argument("--dtype", default=None)
    a = ap.parse_args(argv)
    pid = parent_pid_from_env()
    if pid is not None:
        watch_parent(pid)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = read_config(a.model)
    spec = TPSpec(tp_size=a.tp_size, rank=a.rank, master_address=a.address, master_port=a.port, device=a.device)
    comm = TPComm(spec)
    shard = TPShard(config, a.tp_size, a.rank)
    dtype = DTYPES[a.dtype] if a.dtype else (config.torch_dtype() or torch.float32)
    model = load_rank(a.model, shard, comm, device, dtype)
    geo = comm.recv()
    cache = make_cache(
        shard.local_config,
        num_blocks=geo["num_blocks"],
        block_size=geo["block_size"],
        dtype=dtype,
        device=device,
        num_moe_layers=model.num_moe_layers,
        top_k=model.top_k,
        record_indexer_topk=geo["record_indexer_topk"],
    )
    execute = StepExecutor(model, cache, geo["block_size"], device)
    groups: dict[str, Any] = {}  # weight-update groups joined (SGLang's layout)
    with torch.inference_mode():
        while True:
            msg = comm.recv()
            op = msg.pop("op")
            if op == "step":
                execute(StepInputs(**msg))
            elif op == "stop":
                for g in groups.values():
                    g.destroy()
                comm.destroy()
                return 0
            else:
                _weights_op(op, msg, a.rank, shard, model, comm, groups, device)


def _weights_op(
    op: str,
    msg: dict[str, Any],
    rank: int,
    shard: TPShard,
    model: CausalLM,
    comm: TPComm,
    groups: dict[str, Any],
    device: torch.device,
) -> None:
    """A rank's part of a weight operation (TPDriver's other messages). What fails here fails on rank 0 too and is
    reported there; this rank logs it and goes on serving."""
    from miles_hpc.sync.wire.pg import open_group

    if op == "tensor":
        t = torch.empty(msg["shape"], dtype=getattr(torch, msg["dtype"]))
        comm.control.broadcast(t, src=0)
        _apply_logged(shard, model, [(msg["name"], t)])
    elif op == "gather":
        for _, t in _selected(model, msg.get("names")):
            comm.control.all_gather(t.detach().to("cpu").contiguous())
    elif op == "join":
        spec = dataclasses.replace(GroupSpec(**msg), rank=msg["rank"] + rank)
        try:
            groups[spec.group_name] = open_group(spec, None if spec.backend == "gloo" else device)
        except Exception as e:  # noqa: BLE001 (rank 0's join fails alike and answers the trainer)
            log.warning("rank %d: joining weight-update group %r failed: %s", rank, spec.group_name, e)
    elif op in ("receive", "p2p"):
        try:
            _receive(op, msg, rank, shard, model, groups[msg["group_name"]])
        except Exception as e:  # noqa: BLE001 (a member died: rank 0's receive fails alike and answers the trainer)
            log.warning("rank %d: weight update from group %r failed: %s", rank, msg["group_name"], e)
            broken = groups.pop(msg["group_name"], None)
            if broken is not None:  # at once: members waiting on this rank fail too (weight_receiver `_breaks`)
                broken.destroy()
    elif op == "destroy_group":
        g = groups.pop(msg["group_name"], None)
        if g is not None:
            g.destroy()
    else:
        raise RuntimeError(f"tensor-parallel rank {rank}: unknown message {op!r}")


def _receive(op: str, msg: dict[str, Any], rank: int, shard: TPShard, model: CausalLM, group: Any) -> None:
    """A rank's part of an update from a weight-update group: the whole bucket (``receive``: broadcast) or its own
    parts of it (``p2p``). A broken group raises; rank 0 then marks the weights half-updated until a whole update."""
    if op == "receive":
        bucket = []
        for name, dtype, shape in zip(msg["names"], msg["dtypes"], msg["shapes"], strict=True):
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=group.device)
            group.broadcast(t, src=0)
            crash_point("engine-tp:receiving")  # a tensor of an update received by a rank > 0, the update unfinished
            bucket.append((name, t))
        _apply_logged(shard, model, bucket)
        return
    from .weight_receiver import receive_into

    names = msg["names"]
    shapes = [shard.part_shape(n) for n in names]
    mine = [[(src, tuple(tuple(d) for d in dims)) for src, dims in ranks[rank]] for ranks in msg["tp_pieces"]]
    _apply_logged(shard, model, receive_into(group, names, msg["dtypes"], shapes, mine), parts=True)


def _apply_logged(shard: TPShard, model: CausalLM, named: list[tuple[str, torch.Tensor]], parts: bool = False) -> None:
    try:
        (shard.apply_parts if parts else shard.apply)(model, named)
    except RequestError as e:
        log.warning("rank %d: weight update: %s", shard.rank, e)


if __name__ == "__main__":
    from miles_hpc.faults import enable_stack_dumps

    enable_stack_dumps()  # a native crash or SIGQUIT prints the Python stacks (cli.main does the same)
    sys.exit(_worker(sys.argv[1:]))
