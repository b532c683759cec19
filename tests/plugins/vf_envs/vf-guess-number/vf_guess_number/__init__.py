"""Multi-turn verifiers test environment: guess a number with "higher" / "lower" user turns in between.

The package exports an `Env` subclass next to its Taskset (verifiers pairs them through the package's `__all__`);
its `run()` holds the agent's interaction open and answers each guess with a user turn, as verifiers' own
two-sided environments do. Rewards: solved (weight 1.0) and fewer guesses (weight 0.5).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+")


class GuessData(vf.TaskData):
    target: int
    low: int
    high: int


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 20
    seed: int = 0
    high: int = 10


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 3


def last_guess(text: str) -> int | None:
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def guesses(trace: vf.Trace) -> list[int | None]:
    return [last_guess(m.content or "") for m in trace.assistant_messages]


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        return float(task.target in guesses(trace))

    @vf.reward(weight=0.5)
    async def quick(self, task: GuessData, trace: vf.Trace) -> float:
        made = guesses(trace)
        return 1.0 / (made.index(task.target) + 1) if task.target in made else 0.0


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            target = rng.randint(1, self.config.high)
            yield GuessTask(
                GuessData(
                    prompt=f"I picked a number from 1 to {self.config.high}. Guess it: reply with one number.",
                    target=target,
                    low=1,
                    high=self.config.high,
                ),
                self.config.task,
            )


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        target = task.data.target
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_guesses - 1):
                guess = last_guess(segment.last_reply)
                if guess == target or segment.terminated:
                    break
                hint = "higher" if guess is None or guess < target else "lower"
                segment = await chat.turn(f"No, {hint}. Guess again: one number.")


__all__ = ["GuessEnv", "GuessTaskset"]
