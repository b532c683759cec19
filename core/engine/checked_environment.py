"""Calling environments safely.

:class:`CheckedEnvironment` wraps the environment the trainer plays (the counterpart of
:class:`~palestra.checked_reward.CheckedReward`): ``reset`` and ``step`` run under ``train.data_timeout_s``
and the step watchdog's "data" phase, and what they return is checked against the environment protocol
(:class:`palestra.types.Environment`). A break is one :class:`EnvironmentProtocolError` line naming the environment
by its registered name (``environment 'arithmetic'``) and the rule it broke. The checks are plain functions of
what was returned, so a plugin test kit can run them on an environment without a trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from palestra.engine.watchdog import DataTimeout, StepWatchdog, call_with_timeout
from palestra.types import Observation, StepResult

__all__ = ["CheckedEnvironment", "EnvironmentProtocolError", "check_reset", "check_step"]

T = TypeVar("T")


class EnvironmentProtocolError(ValueError):
    """An environment broke the protocol (or raised). One line, naming the environment and the rule."""

    palestra_user_error = True

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class CheckedEnvironment:
    """An environment whose ``reset``/``step`` are timed, watched and checked (see the module docstring).

    Every other attribute (``agent_ids``, ``max_turns``, ``state_dict``) is the wrapped environment's.
    """

    def __init__(
        self,
        env: Any,
        *,
        name: str,
        path: str = "environment",
        timeout_s: float | None = None,
        watchdog: StepWatchdog | None = None,
    ) -> None:
        self._env, self.name, self.path = env, name, path
        self._timeout_s, self._watchdog = timeout_s, watchdog
        self._live: list[bool] = []  # which rows are still running (their last observation was not None)

    @property
    def label(self) -> str:
        return f"environment {self.name!r}" + (f" ({self.path})" if self.path not in ("environment", self.name) else "")

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        out = self._call("reset", lambda: self._env.reset(batch_size, seed=seed, group_size=group_size))
        broken = check_reset(out, batch_size, group_size, agents=getattr(self._env, "agent_ids", None))
        if broken is not None:
            raise EnvironmentProtocolError(f"{self.label}: {broken}")
        self._live = [True] * len(out)
        return list(out)

    def step(self, actions: Sequence[str | None]) -> StepResult:
        out = self._call("step", lambda: self._env.step(actions))
        broken = check_step(out, actions, self._live, agents=getattr(self._env, "agent_ids", None))
        if broken is not None:
            raise EnvironmentProtocolError(f"{self.label}: {broken}")
        self._live = [obs is not None for obs in out.observations]
        return out

    def _call(self, method: str, fn: Callable[[], T]) -> T:
        # the timeout names the environment's class, as `train.data_timeout_s` has always reported it, and the
        # server it talks to when it has one (an `endpoint` string: openenv's "OpenEnv server http://..."), which
        # the watchdog's phase names too
        what = f"{type(self._env).__name__}.{method}"
        endpoint = getattr(self._env, "endpoint", None)
        phase = "data"
        if isinstance(endpoint, str):
            what, phase = f"{what} ({endpoint})", f"data: {endpoint}"
        try:
            if self._watchdog is None:
                return call_with_timeout(fn, self._timeout_s, what)
            with self._watchdog.phase(phase):
                return call_with_timeout(fn, self._timeout_s, what)
        except (DataTimeout, EnvironmentProtocolError):
            raise
        except ValueError as e:
            if str(e).startswith("StepResult:"):  # StepResult checks its own lengths and done flags
                raise EnvironmentProtocolError(f"{self.label}: {method} built an invalid {e}") from e
            raise EnvironmentProtocolError(f"{self.label}: {method} raised ValueError: {e}") from e
        except Exception as e:
            raise EnvironmentProtocolError(f"{self.label}: {method} raised {type(e).__name__}: {e}") from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def __repr__(self) -> str:
        return f"CheckedEnvironment({self.label}, {self._env!r})"


# ---- the rules ---------------------------------------------------------------------------------------------
def check_reset(out: Any, batch_size: int, group_size: int, *, agents: Sequence[str] | None = None) -> str | None:
    """None if ``out`` keeps the ``reset`` rules, else the rule it broke (one sentence)."""
    n = batch_size * group_size
    want = f"a list of batch_size*group_size = {n} Observation ({batch_size} tasks x {group_size})"
    if not isinstance(out, (list, tuple)):
        return f"reset returned {_kind(out)}; it must return {want}"
    if len(out) != n:
        return f"reset returned {len(out)} observations; it must return {want}"
    for i, obs in enumerate(out):
        problem = _observation_problem(obs, agents)
        if problem is not None:
            return (
                f"reset returned {problem} at row {i};"
                " every row must be a palestra.types.Observation (none is finished yet)"
            )
    return None


def check_step(
    out: Any, actions: Sequence[str | None], live: Sequence[bool], *, agents: Sequence[str] | None = None
) -> str | None:
    """The ``step`` rule ``out`` breaks for ``actions`` (rows ``live`` before the step), or None if it keeps them."""
    n = len(live)
    if not isinstance(out, StepResult):
        return (
            f"step returned {_kind(out)}; it must return a StepResult(observations, done, info) with one entry per row"
        )
    if len(out.observations) != n:
        return (
            f"step returned {len(out.observations)} rows for a batch of {n};"
            " it must return one entry per row (None for a finished row)"
        )
    for i, (obs, info) in enumerate(zip(out.observations, out.info)):
        if obs is not None and not live[i]:
            return f"step returned an observation for row {i}, which had already finished; a finished row stays None"
        if obs is not None:
            problem = _observation_problem(obs, agents)
            if problem is not None:
                return f"step returned {problem} at row {i}; each row must be an Observation or None (finished)"
        if not isinstance(info, dict):
            return f"step returned info {type(info).__name__} at row {i}; info[i] must be a dict (agent id -> dict)"
    return None


def _observation_problem(obs: Any, agents: Sequence[str] | None) -> str | None:
    """What is wrong with one observation (a short phrase), or None."""
    if not isinstance(obs, Observation):
        return "None" if obs is None else f"{type(obs).__name__} {_snippet(obs)}"
    if not isinstance(obs.prompt, str):
        return f"an Observation whose prompt is {type(obs.prompt).__name__}, not str,"
    if agents is not None and obs.agent_id not in agents:
        return f"an Observation for agent {obs.agent_id!r}, not one of agent_ids {tuple(agents)},"
    return None


def _kind(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _snippet(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
