"""Bookkeeping shared by the built-in environments: seeding, group layout and checking ``step`` input."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from palestra.types import Observation, StepResult

T = TypeVar("T")


class _HasTurn(Protocol):
    turn: int


Row = TypeVar("Row", bound=_HasTurn)
AnyRow = TypeVar("AnyRow")  # a row whose end something else decides (a game)


def draw_tasks(
    make: Callable[[random.Random], T], rng: random.Random, batch_size: int, seed: int | None, group_size: int, env: str
) -> list[T]:
    """``batch_size`` tasks from ``make``, each repeated ``group_size`` times in consecutive rows.

    With a seed the tasks depend on the seed alone; without one they come from ``rng`` (the environment's
    own generator), so consecutive resets differ.
    """
    for name, value in (("batch_size", batch_size), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{env}.reset: {name} must be a positive integer, got {value!r}")
    source = random.Random(seed) if seed is not None else rng
    tasks = [make(source) for _ in range(batch_size)]
    return [task for task in tasks for _ in range(group_size)]


def check_actions(env: str, actions: Sequence[str | None], live: Sequence[bool]) -> None:
    """One action per row; a string for every live row (``None`` allowed only for finished rows)."""
    if not any(live):
        raise RuntimeError(f"{env}.step: every episode is done; call reset() to start new ones")
    if len(actions) != len(live):
        raise ValueError(f"{env}.step: got {len(actions)} actions for a batch of {len(live)} rows")
    for i, (action, running) in enumerate(zip(actions, live)):
        if running and not isinstance(action, str):
            raise ValueError(
                f"{env}.step: actions[{i}] must be a string (row {i} is still running), got {type(action).__name__}"
            )


def single_turn_step(
    env: str, actions: Sequence[str | None], live: Sequence[bool], agent_id: str, expected: Sequence[str]
) -> StepResult:
    """The one step of a single-turn question-and-answer environment: every row ends, and each live row's info
    gives ``agent_id`` the expected answer (``expected[i]``). The caller marks its rows finished."""
    check_actions(env, actions, live)
    info = [{agent_id: {"expected": answer}} if running else {} for running, answer in zip(live, expected)]
    n = len(live)
    return StepResult(observations=[None] * n, done=[True] * n, info=info)


def step_rows(
    env: str,
    rows: Sequence[AnyRow],
    actions: Sequence[str | None],
    act: Callable[[AnyRow, str], dict[str, dict[str, Any]]],
    observe: Callable[[AnyRow], Observation],
    is_done: Callable[[AnyRow], bool],
) -> StepResult:
    """One turn of a batched environment: every live row (``not is_done(row)``) applies its action.

    ``act(row, action)`` applies a live row's action and returns its info (``{agent: {...}}``); ``observe(row)``
    makes the row's next observation unless the row is now done. AnyRows already done get no observation and no info.
    """
    live = [not is_done(r) for r in rows]
    check_actions(env, actions, live)
    observations: list[Observation | None] = []
    done: list[bool] = []
    info: list[dict[str, dict[str, Any]]] = []
    for row, running, action in zip(rows, live, actions):
        if not running:
            observations.append(None)
            done.append(True)
            info.append({})
            continue
        assert action is not None
        info.append(act(row, action))
        finished = is_done(row)
        observations.append(None if finished else observe(row))
        done.append(finished)
    return StepResult(observations=observations, done=done, info=info)


def step_turns(
    env: str,
    rows: Sequence[Row],
    actions: Sequence[str | None],
    max_turns: int,
    act: Callable[[Row, str], dict[str, dict[str, Any]]],
    observe: Callable[[Row], Observation],
) -> StepResult:
    """One turn of a turn-based environment whose rows carry a ``turn`` counter: a row is done after ``max_turns``."""

    def act_and_count(row: Row, action: str) -> dict[str, dict[str, Any]]:
        out = act(row, action)
        row.turn += 1
        return out

    return step_rows(env, rows, actions, act_and_count, observe, lambda row: row.turn >= max_turns)
