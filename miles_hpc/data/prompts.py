"""Prompt datasets (stage: data; docs/design.md section 7): load, render to token ids, iterate epoch after epoch.

Invariants:
- A prompt file is JSONL (``.jsonl``, one JSON object per line) or Parquet (``.parquet``/``.pq``, needs pyarrow).
  Loading is strict: a bad row (invalid JSON, not an object, missing prompt/label key, wrong type, empty prompt,
  a blank line) raises :class:`PromptDataError` naming the file and the 1-based line (JSONL) or row (Parquet).
- ``PromptRecord.prompt_id`` is the 0-based row index in the file, so it is stable across runs and resumes.
- ``PromptRecord.metadata`` holds the row's other columns and survives a JSON round trip (it may be copied into
  ``Sample.metadata``, which requires that).
- :class:`PromptIterator`'s order is a pure function of ``(seed, epoch)``; its state is ``(epoch, position)``, so a
  resumed run sees exactly the batches the interrupted run would have seen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Messages",
    "PromptDataError",
    "PromptIterator",
    "PromptRecord",
    "TokenizerLike",
    "load_prompts",
    "render_prompt",
]

Messages = list[dict[str, Any]]
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


class PromptDataError(ValueError):
    """A prompt file problem a user can act on; ``path`` and ``line`` (1-based, None for whole-file problems)."""

    def __init__(self, path: str | Path, line: int | None, message: str, *, unit: str = "line") -> None:
        where = f"{path}" if line is None else f"{path}:{line}" if unit == "line" else f"{path} row {line}"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptRecord:
    """One prompt: plain text or chat messages (``[{"role": ..., "content": ...}, ...]``), its label, extra columns."""

    prompt_id: int
    prompt: str | Messages
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


# -- loading --------------------------------------------------------------------------------------------------------


def _check_prompt(value: Any, key: str) -> str | None:
    """Why ``value`` is not a valid prompt, or None when it is."""
    if isinstance(value, str):
        return None if value.strip() else f"{key!r} is an empty string"
    if isinstance(value, list):
        if not value:
            return f"{key!r} is an empty message list"
        for i, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"{key!r}[{i}] must be a message {{'role': str, 'content': str}}, got {m!r:.80}"
        return None
    return f"{key!r} must be a string or a list of chat messages, got {type(value).__name__}"


def _record(
    row: Any, index: int, path: Path, line: int, prompt_key: str, label_key: str | None, unit: str
) -> PromptRecord:
    def fail(msg: str) -> PromptDataError:
        return PromptDataError(path, line, msg, unit=unit)

    if not isinstance(row, dict):
        raise fail(f"expected a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise fail(f"missing prompt key {prompt_key!r} (keys: {sorted(row)})")
    why = _check_prompt(row[prompt_key], prompt_key)
    if why:
        raise fail(why)
    if label_key is not None and label_key not in row:
        # A typo in label_key would otherwise score every sample 0; data without labels sets label_key to None.
        raise fail(f"missing label key {label_key!r} (keys: {sorted(row)}; use label_key=None for unlabelled data)")
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
    try:
        # allow_nan=False: Sample.metadata requires an exact JSON round trip.
        back = json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise fail(f"extra columns must be JSON-serialisable (they become sample metadata): {e}") from None
    if back != metadata:
        raise fail("extra columns must survive a JSON round trip (str keys, no tuples)")
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        prompt = [dict(m) for m in prompt]
    return PromptRecord(
        prompt_id=index, prompt=prompt, label=row.get(label_key) if label_key else None, metadata=metadata
    )


def _load_jsonl(path: Path, prompt_key: str, label_key: str | None) -> list[PromptRecord]:
    records: list[PromptRecord] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptDataError(
                    path, lineno, f"not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                ) from None
            if not line.strip():
                raise PromptDataError(path, lineno, "blank line (every line must hold one JSON object)")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(path, lineno, f"invalid JSON: {e.msg} at column {e.colno}") from None
            records.append(_record(row, len(records), path, lineno, prompt_key, label_key, "line"))
    return records


def _load_parquet(path: Path, prompt_key: str, label_key: str | None) -> list[PromptRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDataError(path, None, "reading Parquet needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    for key in (prompt_key, label_key):
        if key is not None and key not in table.column_names:
            raise PromptDataError(path, None, f"no column {key!r} (columns: {table.column_names})")
    return [_record(row, i, path, i + 1, prompt_key, label_key, "row") for i, row in enumerate(table.to_pylist())]


def load_prompts(
    path: str | Path, *, prompt_key: str = "prompt", label_key: str | None = "label"
) -> list[PromptRecord]:
    """Read a JSONL or Parquet prompt file into records (``prompt_id`` = 0-based row index).

    ``label_key=None`` reads unlabelled data (every label is None); otherwise each row must have the label key.
    Raises :class:`PromptDataError` naming the file and line/row of the first bad row.
    """
    p = Path(path)
    if not p.is_file():
        raise PromptDataError(p, None, "no such file")
    name = p.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        records = _load_jsonl(p, prompt_key, label_key)
    elif name.endswith(_PARQUET_SUFFIXES):
        records = _load_parquet(p, prompt_key, label_key)
    else:
        raise PromptDataError(p, None, f"unknown format; use one of {_JSONL_SUFFIXES + _PARQUET_SUFFIXES}")
    if not records:
        raise PromptDataError(p, None, "holds no prompts")
    return records


# -- rendering ------------------------------------------------------------------------------------------------------


class TokenizerLike(Protocol):
    """What :func:`render_prompt` needs of a tokenizer (a ``transformers`` tokenizer fits)."""

    def apply_chat_template(self, conversation: Messages, **kwargs: Any) -> Any: ...


def _encode(tokenizer: Any, text: str) -> list[int]:
    # add_special_tokens=False: the template (or the caller's text) already holds every special token it wants.
    if hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def prompt_messages(record: PromptRecord, *, system_prompt: str | None = None) -> Messages:
    """The chat messages of a record: ``[system?] + [user(prompt)]``, or the record's own message list.

    ``system_prompt`` is put first unless the message list already starts with a system message.
    """
    if isinstance(record.prompt, str):
        messages: Messages = [{"role": "user", "content": record.prompt}]
    else:
        messages = [dict(m) for m in record.prompt]
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    record: PromptRecord, tokenizer: Any, *, apply_chat_template: bool = True, system_prompt: str | None = None
) -> list[int]:
    """Token ids of a record's prompt, ready for generation.

    With ``apply_chat_template`` the messages of :func:`prompt_messages` go through the tokenizer's template with
    ``add_generation_prompt=True`` (the text ends where the assistant's answer begins). Without it the prompt text
    is encoded as is; chat-message prompts and ``system_prompt`` then have no defined rendering and raise
    ``ValueError``.
    """
    if apply_chat_template:
        # tokenize=False then encode: transformers' tokenize=True return type differs between major versions.
        text = tokenizer.apply_chat_template(
            prompt_messages(record, system_prompt=system_prompt), tokenize=False, add_generation_prompt=True
        )
        return _encode(tokenizer, text)
    if not isinstance(record.prompt, str):
        raise ValueError(f"prompt {record.prompt_id} is a message list: it needs apply_chat_template=True")
    if system_prompt is not None:
        raise ValueError("system_prompt needs apply_chat_template=True (plain prompts have no system slot)")
    return _encode(tokenizer, record.prompt)


# -- iteration ------------------------------------------------------------------------------------------------------


class PromptIterator:
    """Endless batches of records, epoch after epoch; resumable.

    Epoch ``e`` visits every record once, in an order that depends only on ``(seed, e)`` (identity when
    ``shuffle`` is False). A batch that reaches the end of an epoch is filled from the start of the next, so
    every batch has exactly ``batch_size`` records. ``state_dict()`` is ``{"epoch", "position", ...}``:
    the next batch starts at ``position`` of epoch ``epoch``.
    """

    def __init__(
        self, records: Sequence[PromptRecord], *, batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if not records:
            raise ValueError("PromptIterator needs at least one record")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def records(self) -> list[PromptRecord]:
        """The records iterated over, in dataset order."""
        return self._records

    def __len__(self) -> int:
        """Records per epoch."""
        return len(self._records)

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices into the records, in the order epoch ``epoch`` visits them."""
        order = list(range(len(self._records)))
        if self.shuffle:
            # A string seed goes through sha512 in CPython: stable across versions and platforms.
            random.Random(f"miles-prompts/{self.seed}/{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptRecord]:
        batch: list[PromptRecord] = []
        while len(batch) < self.batch_size:
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.epoch_order(self.epoch), self.epoch
            take = self._order[self.position : self.position + self.batch_size - len(batch)]
            batch.extend(self._records[i] for i in take)
            self.position += len(take)
            if self.position == len(self._records):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        return self

    def __next__(self) -> list[PromptRecord]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self._records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; refuses a state from a different dataset size, seed or shuffle setting."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_records", len(self._records))):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"prompt iterator state has {key}={state[key]!r} but this iterator has {mine!r}: "
                    "the resumed order would differ"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._records):
            raise ValueError(f"prompt iterator state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
