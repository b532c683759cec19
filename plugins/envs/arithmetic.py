"""Built-in environment ``arithmetic``: small sums, one question and one answer per episode.

A single-agent, single-turn, verifiable task small enough for a tiny model to learn: the prompt asks for
``a + b`` (or ``-``, ``*``; more terms and digits as ``difficulty`` grows), the answer goes in an
``<answer>`` tag, and the true value is in the metadata (``metadata["answer"]``) for the ``correctness`` reward.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, check_options, option
from palestra.plugins.envs._episodes import draw_tasks, single_turn_step
from palestra.types import Message, Observation, StepResult

Operation = Literal["+", "-", "*"]


@dataclass
class ArithmeticOptions:
    difficulty: int = option(1, ge=1, le=6)  # digits per operand
    terms: int = option(2, ge=2, le=6)  # operands per question
    max_operand: int | None = option(
        None, ge=1
    )  # cap each operand (for a smaller task than all `difficulty`-digit numbers)
    operations: list[Operation] = field(default_factory=lambda: ["+"])  # drawn uniformly between terms
    answer_tag: str = "answer"
    prompt: str = "What is {question}? Put the final answer in <{tag}></{tag}>."
    agent_id: str = "assistant"

    def __post_init__(self) -> None:
        if not self.operations:
            raise OptionError("operations", "needs at least one of '+', '-', '*'")
        try:
            self.prompt.format(question="1 + 1", tag=self.answer_tag)
        except (KeyError, IndexError, ValueError) as e:
            raise OptionError(
                "prompt", f"may only use the fields {{question}} and {{tag}}: {type(e).__name__}: {e}"
            ) from None
        if "{question}" not in self.prompt:
            raise OptionError("prompt", "must contain {question}")
        low = 0 if self.difficulty == 1 else 10 ** (self.difficulty - 1)
        if self.max_operand is not None and self.max_operand < low:
            raise OptionError(
                "max_operand", f"must be >= {low}, the smallest {self.difficulty}-digit operand, got {self.max_operand}"
            )


@dataclass(frozen=True)
class ArithmeticTask:
    question: str  # "12 + 7"
    answer: int


def evaluate(numbers: Sequence[int], ops: Sequence[str]) -> int:
    """The value of ``n0 op0 n1 op1 n2 ...`` with the usual precedence (``*`` before ``+`` and ``-``)."""
    total, sign, term = 0, 1, numbers[0]
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            term *= n
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), n
    return total + sign * term


class ArithmeticEnv:
    """Batches of arithmetic questions. See :class:`palestra.types.Environment` for the protocol."""

    max_turns = 1

    def __init__(self, **options: Any) -> None:
        self.options: ArithmeticOptions = check_options(ArithmeticOptions, options, where="arithmetic")
        self.agent_ids = (self.options.agent_id,)
        self._rng = random.Random()
        self._tasks: list[ArithmeticTask] = []
        self._live: list[bool] = []

    def make_task(self, rng: random.Random) -> ArithmeticTask:
        o = self.options
        low = 0 if o.difficulty == 1 else 10 ** (o.difficulty - 1)
        high = 10**o.difficulty - 1 if o.max_operand is None else min(10**o.difficulty - 1, o.max_operand)
        numbers = [rng.randint(low, high) for _ in range(o.terms)]
        ops = [rng.choice(o.operations) for _ in range(o.terms - 1)]
        question = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
        return ArithmeticTask(question, evaluate(numbers, ops))

    def observation(self, task: ArithmeticTask) -> Observation:
        o = self.options
        text = o.prompt.format(question=task.question, tag=o.answer_tag)
        return Observation(
            prompt=text,
            agent_id=o.agent_id,
            messages=[Message("user", text)],
            metadata={"answer": str(task.answer), "question": task.question},
            stop=[f"</{o.answer_tag}>"],  # nothing after the closing tag is read, so generating it is waste
        )

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        self._tasks = draw_tasks(self.make_task, self._rng, batch_size, seed, group_size, "arithmetic")
        self._live = [True] * len(self._tasks)
        return [self.observation(t) for t in self._tasks]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        expected = [str(t.answer) for t in self._tasks]
        result = single_turn_step("arithmetic", actions, self._live, self.options.agent_id, expected)
        self._live = [False] * len(self._tasks)
        return result


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "arithmetic",
        ArithmeticEnv,
        options=ArithmeticOptions,
        description="single-agent, single-turn sums with the answer in metadata (difficulty = digits per operand)",
    )
