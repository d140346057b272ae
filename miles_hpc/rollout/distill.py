"""On-policy distillation (OPD): a teacher scores the student's own samples, token by token (stage: rollout).

The teacher is any server with SGLang's `/generate` (our embedded engine or SGLang) holding the teacher model.
`teacher_logprobs` asks it for the log-prob of every token of each sample's sequence with `max_new_tokens=0`,
`return_logprob=True`, `logprob_start_len=0` (a prefill: nothing is generated) and returns the values at the
response positions. The loop then adds, per generated token t, `-coef * (logp_student(t) - logp_teacher(t))` to
the advantage (`opd_advantages`): the per-token reverse KL, whose gradient pulls the student towards the teacher on
the student's own distribution; `algo.opd_only` uses that term alone, otherwise it is added to the task reward's
advantage. `logp_student` is the engine's log-prob of the sampled token (the rollout log-prob), so no extra
student forward is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_hpc.data.sample import Sample
from miles_hpc.rollout.client import EngineClient

__all__ = ["opd_advantages", "teacher_logprobs"]


async def teacher_logprobs(teacher: EngineClient, samples: Sequence[Sample]) -> list[list[float]]:
    """Per sample, the teacher's log-prob of each token (0.0 at the first token, which has none)."""

    async def one(s: Sample) -> list[float]:
        out = await teacher.generate(list(s.tokens), {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        lps = out.input_logprobs or []
        if len(lps) != len(s.tokens):
            raise ValueError(f"teacher {teacher.url} scored {len(lps)} of the {len(s.tokens)} tokens of a sample")
        return [0.0 if v is None else float(v) for v in lps]

    return list(await asyncio.gather(*(one(s) for s in samples)))


def opd_advantages(
    task_adv: Sequence[Sequence[float]],
    samples: Sequence[Sample],
    teacher: Sequence[Sequence[float]],
    coef: float,
    *,
    only: bool = False,
) -> tuple[list[list[float]], float]:
    """Per-token advantages with the OPD term on loss tokens, and the mean reverse KL (student - teacher) there."""
    out, kl_sum, n = [], 0.0, 0
    for adv, s, t in zip(task_adv, samples, teacher):
        row = []
        for a, m, lp, tl in zip(adv, s.loss_mask, s.rollout_logprobs, t):
            if not m:
                row.append(0.0)
                continue
            kl = lp - tl
            kl_sum, n = kl_sum + kl, n + 1
            row.append((0.0 if only else a) - coef * kl)
        out.append(row)
    return out, (kl_sum / n if n else 0.0)
