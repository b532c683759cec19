"""``check_environment``: the environment contract the trainer's rollout relies on, rule by rule.

The trainer resets a batch of ``batch_size * group_size`` episodes with a seed, then steps every live row
with one action until all are done or ``max_turns`` is reached (:func:`palestra.engine.rollout.run_episodes`),
and hands each episode's metadata to the reward. Every rule below is something that loop assumes.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palestra.testing import environment_rules as rules
from palestra.testing.compare import first_difference
from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract
from palestra.testing.samples import SEED, cycle_completions
from palestra.types import Observation, Stateful, StepResult

__all__ = ["RULES", "check_environment"]

Respond = Callable[[list[Observation]], Sequence[str]]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the environment from the options given",
    "agent ids": "agent_ids is a non-empty tuple of distinct agent names",
    "max turns": "max_turns is a positive int",
    "reset runs": "reset(batch_size, seed=..., group_size=...) returns without raising",
    "one observation per row": "reset returns a list of batch_size * group_size observations",
    "observations": (
        "each is a palestra.Observation: str prompt, dict metadata, an agent_id from agent_ids, "
        "valid stop/token_ids/max_new_tokens"
    ),
    "groups share a task": "rows [g * G, (g + 1) * G) have the same prompt and metadata",
    "first turn is 0": "reset's observations have turn 0",
    "same seed, same tasks": "reset with one seed gives equal observations, on the same instance and on a fresh one",
    "step runs": "step(actions) with one str per live row and None per finished row returns without raising",
    "one result per row": "step returns a palestra.StepResult with one observation, done flag and info entry per row",
    "done rows stay done": "a finished row stays done, with observation None, in every later step",
    "info by agent": "info[i] maps agent ids from agent_ids to dicts",
    "turns count up": "a live row's next observation has turn = its previous turn + 1",
    "same actions, same steps": "two instances reset with one seed and given the same actions return equal steps "
    "(info keys ending in _s are wall-clock seconds and not compared)",
    "metadata is plain data": "episode metadata pickles (it travels between ranks and into checkpoints)",
    "metadata reaches the reward": "the reward given to the check scores the episodes' reward rows",
    "one-row batch": "after a bigger batch, reset(1) starts a new batch of one row that steps with one action",
    "empty batch": "reset(0) returns [] or raises ValueError",
    "state round-trip": (
        "state_dict and load_state_dict come together; the state deep-copies, loads into a fresh instance and gives "
        "the same seeded resets"
    ),
}


def check_environment(
    environment: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    batch_size: int = 2,
    group_size: int = 2,
    seed: int = SEED,
    respond: Respond | None = None,
    reward: str | Callable[..., Any] | None = None,
    reward_options: Mapping[str, Any] | None = None,
) -> None:
    """Check a registered environment (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    ``respond`` plays the agents (default: a fixed cycle of plausible completions); ``reward``, when given, must
    score the episodes' reward rows (the environment's metadata is what it reads).
    """
    subj = subject("environment", environment, options, name=name)
    c = Contract("environment", subj.label, RULES)
    respond = respond or (lambda obs: cycle_completions(len(obs)))
    env = _build(subj, c)
    for attribute, rule, problem_of in (
        ("agent_ids", "agent ids", rules.agent_ids_problem),
        ("max_turns", "max turns", rules.max_turns_problem),
    ):
        problem = problem_of(getattr(env, attribute, None))
        c.require(problem is None, attribute, rule, problem or "")

    first = _reset(env, c, batch_size, group_size, seed)
    _same(
        c,
        "reset",
        "same seed, same tasks",
        first,
        _reset(env, c, batch_size, group_size, seed),
        "a second reset on the same instance",
    )
    _play([env, _build(subj, c)], c, batch_size, group_size, seed, respond)
    _check_metadata(_build(subj, c), c, batch_size, group_size, seed, respond, reward, reward_options)
    _check_one_row(env, c, seed, respond)
    _check_empty(env, c, group_size, seed)
    _check_state(env, subj, c, batch_size, group_size, seed)


# ---- reset ----------------------------------------------------------------------------------------------
def _build(subj: Subject, c: Contract) -> Any:
    with c.calling("build", "builds from its options"):
        return subj.make()


def _reset(env: Any, c: Contract, batch_size: int, group_size: int, seed: int | None) -> list[Observation]:
    with c.calling("reset", "reset runs"):
        obs = env.reset(batch_size, seed=seed, group_size=group_size)
    broken = rules.reset_problem(obs, batch_size, group_size, env.agent_ids)
    if broken is not None:
        raise c.fail("reset", *broken)
    for row, o in enumerate(obs):
        problem = rules.observation_fields_problem(o, row)
        c.require(problem is None, "reset", "observations", problem or "")
        c.require(o.turn == 0, "reset", "first turn is 0", f"row {row} has turn {o.turn}")
    problem = rules.group_problem(obs, group_size)
    c.require(problem is None, "reset", "groups share a task", problem or "")
    return list(obs)


def _same(c: Contract, method: str, rule: str, a: Any, b: Any, what: str) -> None:
    found = first_difference(a, b, "observations" if method == "reset" else "result")
    c.require(found is None, method, rule, f"{what} differs: {found}")


# ---- step -----------------------------------------------------------------------------------------------
def _play(envs: list[Any], c: Contract, batch_size: int, group_size: int, seed: int, respond: Respond) -> None:
    """Play one batch on several instances in lock step, checking every step of the first against the rules and
    the others against the first."""
    current: list[Observation | None] = list(_reset(envs[0], c, batch_size, group_size, seed))
    for other in envs[1:]:
        _same(
            c,
            "reset",
            "same seed, same tasks",
            current,
            _reset(other, c, batch_size, group_size, seed),
            "a fresh instance's reset",
        )
    n = len(current)
    env = envs[0]
    for _ in range(env.max_turns):
        live = [i for i, o in enumerate(current) if o is not None]
        if not live:
            break
        actions: list[str | None] = [None] * n
        for i, reply in zip(live, respond([current[i] for i in live])):  # type: ignore[misc]
            actions[i] = reply
        results = [_step(e, c, actions, [o is not None for o in current]) for e in envs]
        result = results[0]
        _check_step(env, c, current, result)
        for other in results[1:]:
            _same(c, "step", "same actions, same steps", _untimed(result), _untimed(other), "a second instance's step")
        current = list(result.observations)


def _untimed(result: Any) -> Any:
    """``result`` without the wall-clock measurements in its info, which no two runs share (an agent's latency, a
    tool call's): keys ending in ``_s`` (seconds, by convention) at any depth."""
    return dataclasses.replace(result, info=_strip_times(result.info)) if isinstance(result, StepResult) else result


def _strip_times(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _strip_times(v) for k, v in value.items() if not (isinstance(k, str) and k.endswith("_s"))}
    if isinstance(value, (list, tuple)):
        return [_strip_times(v) for v in value]
    return value


def _step(env: Any, c: Contract, actions: list[str | None], live: list[bool]) -> Any:
    try:
        result = env.step(list(actions))
    except ValueError as e:
        if str(e).startswith("StepResult:"):  # StepResult checks its own lengths and done flags when built
            raise c.fail("step", "one result per row", f"built an invalid {e}") from e
        raise c.fail("step", "step runs", f"raised ValueError: {e}") from e
    except Exception as e:
        raise c.fail("step", "step runs", f"raised {type(e).__name__}: {e}") from e
    broken = rules.step_problem(result, actions, live, env.agent_ids)
    if broken is not None:
        raise c.fail("step", *broken)
    return result


def _check_step(env: Any, c: Contract, before: list[Observation | None], result: Any) -> None:
    for row, (prev, obs) in enumerate(zip(before, result.observations)):
        if prev is None:
            continue
        problem = rules.info_problem(result.info[row], row, env.agent_ids)
        c.require(problem is None, "step", "info by agent", problem or "")
        if obs is None:
            continue
        problem = rules.observation_fields_problem(obs, row)
        c.require(problem is None, "step", "observations", problem or "")
        c.require(
            obs.turn == prev.turn + 1,
            "step",
            "turns count up",
            f"row {row} went from turn {prev.turn} to turn {obs.turn}",
        )


# ---- metadata, batch sizes, state -------------------------------------------------------------------------
def _check_metadata(
    env: Any,
    c: Contract,
    batch_size: int,
    group_size: int,
    seed: int,
    respond: Respond,
    reward: Any,
    reward_options: Mapping[str, Any] | None,
) -> None:
    from palestra.checked_reward import CheckedReward
    from palestra.engine.rollout import reward_rows, run_episodes

    with c.calling("step", "step runs"):
        episodes = run_episodes(env, respond, batch_size, seed=seed, group_size=group_size)
    prompts, completions, metadata = reward_rows(episodes)
    for row, meta in enumerate(metadata):
        try:
            pickle.dumps(meta)
        except Exception as e:
            raise c.fail(
                "reset", "metadata is plain data", f"row {row}'s metadata does not pickle: {type(e).__name__}: {e}"
            ) from e
    if reward is None:
        return
    scorer = subject("reward", reward, reward_options)
    with c.calling("step", "metadata reaches the reward"):
        CheckedReward(scorer.make(), name=scorer.label)(prompts, completions, metadata)


def _check_one_row(env: Any, c: Contract, seed: int, respond: Respond) -> None:
    with c.calling("reset", "one-row batch"):
        obs = env.reset(1, seed=seed, group_size=1)
    broken = rules.reset_problem(obs, 1, 1, env.agent_ids)
    c.require(broken is None, "reset", "one-row batch", broken[1] if broken else "")
    actions: list[str | None] = list(respond(list(obs)))
    with c.calling("step", "one-row batch"):
        result = env.step(actions)
    broken = rules.step_problem(result, actions, [True], env.agent_ids)
    c.require(broken is None, "step", "one-row batch", broken[1] if broken else "")


def _check_empty(env: Any, c: Contract, group_size: int, seed: int) -> None:
    try:
        obs = env.reset(0, seed=seed, group_size=group_size)
    except ValueError:
        return  # refusing an empty batch is fine: the trainer never asks for one
    except Exception as e:
        raise c.fail("reset", "empty batch", f"raised {type(e).__name__} (expected [] or ValueError): {e}") from e
    c.require(obs == [], "reset", "empty batch", f"returned {obs!r}; expected []")


def _check_state(env: Any, subj: Subject, c: Contract, batch_size: int, group_size: int, seed: int) -> None:
    has = [hasattr(env, m) for m in ("state_dict", "load_state_dict")]
    if not any(has):
        return
    c.require(
        isinstance(env, Stateful),
        "state_dict",
        "state round-trip",
        "has only one of state_dict and load_state_dict; the trainer saves state only when both exist",
    )
    with c.calling("state_dict", "state round-trip"):
        state = copy.deepcopy(env.state_dict())
    fresh = _build(subj, c)
    with c.calling("load_state_dict", "state round-trip"):
        fresh.load_state_dict(state)
        reloaded = fresh.state_dict()
    found = first_difference(env.state_dict(), reloaded, "state")
    c.require(
        found is None,
        "load_state_dict",
        "state round-trip",
        f"a fresh instance loaded from state_dict() reports another state: {found}",
    )
    found = first_difference(
        env.reset(batch_size, seed=seed, group_size=group_size),
        fresh.reset(batch_size, seed=seed, group_size=group_size),
        "observations",
    )
    c.require(
        found is None,
        "load_state_dict",
        "state round-trip",
        f"after loading the state, a seeded reset differs: {found}",
    )
