"""``check_reward``: the reward contract the trainer relies on, rule by rule.

The trainer calls ``reward(prompts, completions, metadata)`` on every episode's last turn, the metadata being
the environment's; it wants a float tensor ``[B]`` of finite scores (or a ``RewardOutput`` holding one), checkpoints
the reward's state when it has one, and scores held-out rows on a copy (or through ``evaluate``).

The kit is stricter than the trainer's own guard (:class:`~palestra.checked_reward.CheckedReward`), which
converts a list to a tensor on the fly: a plugin's tests are the place to return the real thing.
"""

from __future__ import annotations

import copy
import io
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palestra.testing.compare import first_difference
from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract
from palestra.testing.samples import COMPLETIONS, SEED, cycle_completions
from palestra.types import HeldOutScoring, RewardOutput, Stateful

__all__ = ["RULES", "check_reward", "reward_rows"]

Rows = tuple[list[str], list[str], list[dict[str, Any]]]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the reward from the options given",
    "call runs": (
        "reward(prompts, completions, metadata) returns without raising on plausible completions, "
        "the empty one included"
    ),
    "scores are a float tensor": (
        "it returns a floating-point torch.Tensor, or a RewardOutput whose scores is one (not a list, not ints)"
    ),
    "one score per row": "scores has shape [B]",
    "scores are finite": "no score is NaN or infinite",
    "components are [B] float tensors": "each RewardOutput component is a floating-point tensor of shape [B]",
    "metrics are finite numbers": "each RewardOutput metric is a finite int or float",
    "metadata is read-only": "the metadata rows are unchanged after the call",
    "same rows, same scores": "two fresh instances score the same rows the same, bit for bit",
    "scores within max_score": "when the reward declares max_score, no score exceeds it",
    "one-row batch": "a single row gets scores of shape [1]",
    "empty batch": "no rows get scores of shape [0]",
    "can be copied": "copy.deepcopy works (held-out scoring runs on a copy)",
    "evaluate leaves state alone": "evaluate(...) returns a RewardOutput and leaves state_dict() unchanged",
    "state round-trip": (
        "state_dict and load_state_dict come together; the state saves with torch.save, and a fresh instance loaded "
        "from it continues identically"
    ),
}


def reward_rows(
    environment: str | Callable[..., Any] = "arithmetic",
    options: Mapping[str, Any] | None = None,
    *,
    batch_size: int = 2,
    group_size: int = 2,
    seed: int = SEED,
    completions: Sequence[str] | None = None,
) -> Rows:
    """``(prompts, completions, metadata)`` as the trainer would hand a reward: an environment's episodes, played with
    ``completions`` (default: a cycle of plausible ones, the empty string included)."""
    from palestra.engine.rollout import reward_rows as rows_of
    from palestra.engine.rollout import run_episodes

    env = subject("environment", environment, options).make()
    pool = tuple(completions) if completions else COMPLETIONS
    episodes = run_episodes(
        env, lambda obs: cycle_completions(len(obs), pool), batch_size, seed=seed, group_size=group_size
    )
    return rows_of(episodes)


def check_reward(
    reward: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    environment: str | Callable[..., Any] = "arithmetic",
    environment_options: Mapping[str, Any] | None = None,
    rows: Rows | None = None,
) -> None:
    """Check a registered reward (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    The rows scored come from ``environment`` (default: the built-in ``arithmetic``, whose metadata holds
    ``answer`` and ``question``), or are given as ``rows = (prompts, completions, metadata)``.
    """
    subj = subject("reward", reward, options, name=name)
    c = Contract("reward", subj.label, RULES)
    prompts, completions, metadata = rows if rows is not None else reward_rows(environment, environment_options)
    first = _build(subj, c)
    out = _score(first, c, prompts, completions, metadata, "__call__")
    _check_max_score(first, c, out)
    second = _score(_build(subj, c), c, prompts, completions, metadata, "__call__")
    found = first_difference(out, second, "output")
    c.require(
        found is None, "__call__", "same rows, same scores", f"a second fresh instance scored differently: {found}"
    )
    with c.calling("__deepcopy__", "can be copied"):
        spare = copy.deepcopy(first)
    one = _score(spare, c, prompts[:1], completions[:1], metadata[:1], "__call__", rule_for_size="one-row batch")
    c.require(
        one.scores.shape == (1,), "__call__", "one-row batch", f"one row got scores of shape {list(one.scores.shape)}"
    )
    _check_empty(first, c)
    _check_evaluate(first, c, prompts, completions, metadata)
    _check_state(first, subj, c, prompts, completions, metadata)


def _build(subj: Subject, c: Contract) -> Any:
    with c.calling("build", "builds from its options"):
        return subj.make()


def _score(
    reward: Any,
    c: Contract,
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    method: str,
    *,
    rule_for_size: str = "one score per row",
) -> RewardOutput:
    """Call the reward (or its ``evaluate``) and check what it returns; the output as a RewardOutput."""
    before = copy.deepcopy(metadata)
    call = reward.evaluate if method == "evaluate" else reward
    with c.calling(method, "call runs"):
        out = call(list(prompts), list(completions), metadata)
    found = first_difference(before, metadata, "metadata")
    c.require(found is None, method, "metadata is read-only", f"the call changed its input: {found}")
    if method == "evaluate":
        c.require(
            isinstance(out, RewardOutput),
            method,
            "evaluate leaves state alone",
            f"returned {type(out).__name__}; expected a RewardOutput",
        )
    output = out if isinstance(out, RewardOutput) else RewardOutput(out)
    b = len(completions)
    _check_scores(c, method, output.scores, b, "scores", rule_for_size)
    for key, value in output.components.items():
        c.require(
            _is_float_tensor(value) and tuple(value.shape) == (b,),
            method,
            "components are [B] float tensors",
            f"component {key!r} is {_describe(value)}; expected a float tensor of shape [{b}]",
        )
    for key, metric in output.metrics.items():
        ok = isinstance(metric, numbers.Real) and not isinstance(metric, bool) and math.isfinite(metric)
        c.require(ok, method, "metrics are finite numbers", f"metric {key!r} is {_describe(metric)}")
    return output


def _check_scores(c: Contract, method: str, scores: Any, b: int, what: str, rule_for_size: str) -> None:
    import torch

    c.require(
        _is_float_tensor(scores),
        method,
        "scores are a float tensor",
        f"returned {_describe(scores)}; expected a float tensor of shape [{b}] "
        "(e.g. torch.tensor(values, dtype=torch.float32))",
    )
    c.require(
        tuple(scores.shape) == (b,),
        method,
        rule_for_size,
        f"{what} has shape {list(scores.shape)} for {b} rows; expected [{b}]",
    )
    bad = (~torch.isfinite(scores.detach())).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise c.fail(method, "scores are finite", f"row {row} scored {scores[row].item()}")


def _check_max_score(reward: Any, c: Contract, out: RewardOutput) -> None:
    best = getattr(reward, "max_score", None)
    if not isinstance(best, numbers.Real) or isinstance(best, bool):
        return
    top = float(out.scores.max()) if out.scores.numel() else -math.inf
    c.require(top <= float(best), "__call__", "scores within max_score", f"scored {top} above max_score={best}")


def _check_empty(reward: Any, c: Contract) -> None:
    # On a copy: an empty batch must not be what a stateful reward's moving averages remember.
    with c.calling("__call__", "empty batch"):
        out = copy.deepcopy(reward)([], [], [])
    scores = out.scores if isinstance(out, RewardOutput) else out
    c.require(
        _is_float_tensor(scores) and tuple(scores.shape) == (0,),
        "__call__",
        "empty batch",
        f"no rows got {_describe(scores)}; expected a float tensor of shape [0]",
    )


def _check_evaluate(
    reward: Any, c: Contract, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
) -> None:
    if not isinstance(reward, HeldOutScoring):
        return
    before = _state(reward, c)
    _score(reward, c, prompts, completions, metadata, "evaluate")
    found = first_difference(before, _state(reward, c), "state")
    c.require(found is None, "evaluate", "evaluate leaves state alone", f"evaluate changed the state: {found}")


def _state(reward: Any, c: Contract) -> Any:
    if not isinstance(reward, Stateful):
        return None
    with c.calling("state_dict", "state round-trip"):
        return copy.deepcopy(reward.state_dict())


def _check_state(
    reward: Any, subj: Subject, c: Contract, prompts: list[str], completions: list[str], metadata: list[dict[str, Any]]
) -> None:
    import torch

    has = [hasattr(reward, m) for m in ("state_dict", "load_state_dict")]
    if not any(has):
        return
    c.require(
        all(has),
        "state_dict",
        "state round-trip",
        "has only one of state_dict and load_state_dict; the trainer saves state only when both exist",
    )
    state = _state(reward, c)  # the first instance has scored rows already: its state has moved
    try:
        torch.save(state, io.BytesIO())
    except Exception as e:
        raise c.fail(
            "state_dict", "state round-trip", f"torch.save cannot write the state: {type(e).__name__}: {e}"
        ) from e
    fresh = _build(subj, c)
    with c.calling("load_state_dict", "state round-trip"):
        fresh.load_state_dict(copy.deepcopy(state))
    found = first_difference(state, _state(fresh, c), "state")
    c.require(
        found is None,
        "load_state_dict",
        "state round-trip",
        f"a fresh instance loaded from state_dict() reports another state: {found}",
    )
    a = _score(reward, c, prompts, completions, metadata, "__call__")
    b = _score(fresh, c, prompts, completions, metadata, "__call__")
    found = first_difference(a, b, "output")
    c.require(
        found is None,
        "load_state_dict",
        "state round-trip",
        f"a fresh instance loaded from state_dict() then scores differently: {found}",
    )


def _is_float_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80]
