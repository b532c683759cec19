"""Single-turn verifiers test environment: reverse a word, answered inside <answer></answer>.

Two weighted rewards (the exact answer, weight 1.0; the answer tags present, weight 0.2) and one metric, so a test
can check that each reward function becomes a named component with its weight.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

WORDS = [
    *("cat", "dog", "sun", "map", "cup", "pen", "owl", "fox", "bee", "ant"),
    *("tree", "lamp", "bird", "fish", "rock", "sand", "wind", "rain", "snow", "moon"),
    *("apple", "river", "stone", "cloud", "piano", "tiger", "lemon", "grape"),
]

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReverseData(vf.TaskData):
    word: str
    answer: str


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 20
    seed: int = 0
    max_len: int = 8


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        found = ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip() == task.answer)

    @vf.reward(weight=0.2)
    async def tags(self, trace: vf.Trace) -> float:
        return float(ANSWER.search(trace.last_reply) is not None)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        if self.config.num_tasks < 1:
            raise ValueError("num_tasks must be at least 1")
        rng = random.Random(self.config.seed)
        words = [w for w in WORDS if len(w) <= self.config.max_len]
        for _ in range(self.config.num_tasks):
            word = rng.choice(words)
            yield ReverseTask(
                ReverseData(
                    prompt=f"Reverse the word '{word}'. Reply with the reversed word inside <answer></answer>.",
                    system_prompt="You reverse words.",
                    word=word,
                    answer=word[::-1],
                ),
                self.config.task,
            )


__all__ = ["ReverseTaskset"]
