"""The `WeightSync` protocol every strategy implements, its errors, and checksum verification (stage: sync).

A strategy moves the trainer's HF-named tensors to a set of engines and sets their `weight_version`; the
`Publisher` (publish.py) wraps every strategy in the same cycle: pause -> transfer -> verify -> continue, and
handles engines that fail. A strategy knows nothing of pausing, routers or retries.

Contract of a strategy:
- `connect(clients)` (re)builds whatever the transfer needs to reach exactly these engines (a process group, a
  directory); called again when the set of engines changes; `clients` says the current set.
- `push(named, version)` consumes the whole iterator (trainer-side iterators are collectives: every rank steps
  through them), sends, and returns the checksum (`sync.wire.checksum.tensor_checksum`) of each tensor as the engines
  must now hold it. The last part of the update carries `version`; an engine that received only part of it
  refuses to continue generation (engine/core.py `resume`), so a trainer that dies mid-push never leaves a
  half-updated engine serving.
- `takes_named`: False for a strategy that moves the trainer's shards itself (p2p): the publisher then hands
  `push` an empty iterator instead of building the gathered one.
- `verify(clients, expected)` checks that every engine holds what `push` returned (`verify_checksums`: one
  checksum per tensor; p2p: one per held piece, `verify_pieces`): a mismatch raises `WeightSyncError`, an engine
  whose check failed (it died after the transfer) `EngineSyncError` naming it.
- What it knows of itself (strategies/base.py `Strategy`): `sends` and `source(trainer)` (full state or the
  adapter), `publish_at_start`, `engine_needs`, `check_placement`, and `metrics()` of the last push.
- Failures raise `EngineSyncError` naming the engines that failed when the strategy can tell (the publisher then
  takes them out of the fleet and retries with the others), `WeightSyncError` otherwise (the run stops).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch

from miles_hpc.planner.transfer import Box
from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.strategies.base import Sends, SyncSource

__all__ = ["EngineSyncError", "WeightSync", "WeightSyncError", "check_answers", "verify_checksums", "verify_pieces"]


class WeightSyncError(RuntimeError):
    """A weight update failed or did not verify; the message names the engine and tensor."""


class EngineSyncError(WeightSyncError):
    """Some engines failed their part of an update; the others may be retried without them."""

    def __init__(self, failed: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.failed = tuple(failed)  # engine URLs


@runtime_checkable
class WeightSync(Protocol):
    """One weight-update strategy (broadcast, p2p, delta, colocated, lora): see the module docstring."""

    name: ClassVar[str]
    sends: ClassVar[Sends]
    takes_named: ClassVar[bool]
    publish_at_start: ClassVar[bool]

    @property
    def clients(self) -> Sequence[EngineClient]: ...

    async def connect(self, clients: Sequence[EngineClient]) -> None: ...

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]: ...

    async def verify(self, clients: Sequence[EngineClient], expected: dict[str, str]) -> None: ...

    async def close(self) -> None: ...

    def source(self, trainer: SyncSource) -> Callable[[], Iterable[tuple[str, torch.Tensor]]]: ...

    def metrics(self) -> dict[str, float]: ...


async def engine_tp_sizes(clients: Sequence[EngineClient]) -> list[int]:
    """Each engine's tensor-parallel size, from ``/get_server_info``'s ``tp_size`` (SGLang's server argument; our
    engine's EngineConfig field); an engine that reports none counts as 1."""
    infos = await asyncio.gather(*(c.server_info() for c in clients))
    sizes = []
    for c, info in zip(clients, infos):
        tp = info.get("tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise WeightSyncError(f"{c.url}: /get_server_info tp_size is {tp!r}, expected a positive int")
        sizes.append(tp)
    return sizes


async def verify_checksums(clients: Sequence[EngineClient], expected: dict[str, str]) -> None:
    """Every engine holds exactly the tensors sent: compare its per-tensor checksums (HF names) with `expected`;
    raise naming the engine and the first tensor that differs (`check_answers`)."""
    answers = await asyncio.gather(*(c.weights_checksums() for c in clients), return_exceptions=True)
    held = [
        a if isinstance(a, BaseException) else {k: v for r in a.ranks for k, v in r.checksums.items()} for a in answers
    ]
    check_answers(clients, held, expected, "weight checksum", "tensor")


async def verify_pieces(
    clients: Sequence[EngineClient], pieces: Mapping[str, Sequence[Box]], expected: dict[str, str]
) -> None:
    """As `verify_checksums`, per piece: each engine hashes the given boxes of its tensors (`piece_key` names);
    the boxes partition each tensor, so equal piece checksums mean equal tensors."""
    names = list(pieces)
    boxes = [[[x for d in b.dims for x in d] for b in pieces[n]] for n in names]
    answers = await asyncio.gather(*(c.weights_piece_checksums(names, boxes) for c in clients), return_exceptions=True)
    check_answers(clients, answers, expected, "weight checksum", "tensor piece")


def check_answers(
    clients: Sequence[EngineClient],
    answers: Sequence[Mapping[str, str] | BaseException],
    expected: Mapping[str, str],
    what: str,
    unit: str,
) -> None:
    """Each engine's checksums (or the error its call raised) against `expected`: a mismatch of an engine that
    answered raises WeightSyncError naming it and the first `unit` that differs (the run stops); otherwise engines
    whose call failed (died after the transfer: a tensor-parallel rank gone, the process gone) raise
    EngineSyncError naming them, which the publisher treats as in a transfer (drops those no longer healthy)."""
    failed: list[tuple[str, Exception]] = []
    for client, got in zip(clients, answers):
        if isinstance(got, BaseException):
            if not isinstance(got, Exception):
                raise got  # cancelled: not the engine's failure
            failed.append((client.url, got))
            continue
        for name, want in expected.items():
            if got.get(name) != want:
                raise WeightSyncError(
                    f"{what} mismatch on {client.url} for {unit} {name!r}: trainer {want}, engine "
                    f"{got.get(name, 'missing')}"
                )
    if failed:
        url, error = failed[0]
        raise EngineSyncError([u for u, _ in failed], f"checking the weights failed on {url}: {error}")
