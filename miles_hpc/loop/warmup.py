"""Supervised warm-up before RL (stage: loop): a few teacher-forced steps on the prompt data's labels.

A random-init model almost never emits an answer followed by the end-of-turn token, so every GRPO group has zero
reward variance and RL has no signal. The warm-up trains on ``prompt -> label + eos`` through the same trainer and
loss: with advantage 1 on the answer tokens and the PPO ratio at 1 (the trainer computes the old log-probs itself),
the policy gradient is exactly the negative log-likelihood gradient of the answer. The batches are marked
``supervised``: the run's off-policy corrections (TIS, MIS) and KL penalty do not apply to them (train/step.py).

``shuffle_labels`` pairs every prompt with the label of another record: the model learns the answer *format*
(one digit, then stop) but not which answer is right, so the reward after the warm-up stays at chance and any rise
during RL is RL's doing, not the warm-up's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.sample import token_hash
from miles_hpc.train.batch import TrainBatch


def warmup_batches(
    records: Sequence[PromptRecord],
    render: Callable[[PromptRecord], list[int]],
    tokenizer: Any,
    *,
    steps: int,
    batch_size: int,
    shuffle_labels: bool,
    seed: int,
) -> Iterator[TrainBatch]:
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: the warm-up cannot teach the model to stop")
    for _ in range(steps):
        chosen = rng.sample(list(records), min(batch_size, len(records)))
        labels = [r.label for r in chosen]
        if shuffle_labels:
            labels = [rng.choice(records).label for _ in chosen]
        tokens, masks = [], []
        for rec, label in zip(chosen, labels):
            prompt = render(rec)
            answer = tokenizer.encode(str(label), add_special_tokens=False) + [eos]
            tokens.append(prompt + answer)
            masks.append([0] * len(prompt) + [1] * len(answer))
        yield TrainBatch(
            tokens=tokens,
            loss_mask=masks,
            rollout_logprobs=[[0.0] * len(t) for t in tokens],
            advantages=[[float(m) for m in mask] for mask in masks],
            token_hash=[token_hash(t) for t in tokens],
            supervised=True,
        )
