"""Sums of two small numbers (``3+4 =``), answered as ``<answer>7</answer>``: a verifiers environment package.

Every sum of two operands in ``0..max_operand`` is one task (25 with the default 4), in a fixed shuffled order
(``seed``). Two weighted rewards, verifiers' way: ``correct`` (weight 1.0) for the right number in the tags, and
``formatted`` (weight 1.0) for a reply that is exactly one tag holding a number.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

TAGGED = re.compile(r"<answer>(-?\d+)</answer>")


class SumData(vf.TaskData):
    answer: str


class SumsConfig(vf.TasksetConfig):
    max_operand: int = 4
    seed: int = 0


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        found = TAGGED.findall(trace.last_reply)
        return float(bool(found) and found[-1] == task.answer)

    @vf.reward(weight=1.0)
    async def formatted(self, trace: vf.Trace) -> float:
        return float(TAGGED.fullmatch(trace.last_reply) is not None)


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        n = self.config.max_operand
        pairs = [(a, b) for a in range(n + 1) for b in range(n + 1)]
        random.Random(self.config.seed).shuffle(pairs)
        for a, b in pairs:
            yield SumTask(SumData(prompt=f"{a}+{b} =", answer=str(a + b)), self.config.task)


__all__ = ["SumsTaskset"]
