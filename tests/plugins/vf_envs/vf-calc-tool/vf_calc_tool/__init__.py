"""Tool verifiers test environment: word problems with a calculator toolset (add, multiply).

The toolset is a verifiers `Toolset` whose `@vf.tool` methods are served to the model as `calc_add` and
`calc_multiply` (the toolset's TOOL_PREFIX, then the method name). Rewards: the right number in the final reply
(weight 1.0) and at least one tool call (weight 0.1).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalcToolset(vf.Toolset):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: float, b: float) -> str:
        """Add two numbers and return the sum."""
        return _show(a + b)

    @vf.tool
    async def multiply(self, a: float, b: float) -> str:
        """Multiply two numbers and return the product."""
        return _show(a * b)


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class CalcData(vf.TaskData):
    answer: str


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 20
    seed: int = 0


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(trace.last_reply)
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            a, b, c = rng.randint(2, 9), rng.randint(10, 99), rng.randint(2, 9)
            yield CalcTask(
                CalcData(
                    prompt=f"A box holds {b} pens. How many pens are in {a} boxes plus {c} loose pens? "
                    "Use the tools, then give the number.",
                    answer=str(a * b + c),
                ),
                self.config.task,
            )


__all__ = ["CalcTaskset"]
