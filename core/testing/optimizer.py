"""``check_optimizer``: an RL algorithm (the ``optimizer`` registry kind) on a real tiny learner, rule by rule.

The trainer builds a :class:`~palestra.engine.learner.Learner` around the algorithm once (``Learner(algorithm,
policy, context, reference=...)``), then per step calls the learner's ``prepare(batch)`` (which calls the algorithm's
``advantages``) and ``update(batch)`` (which calls its ``loss`` on the policy's scores), logs the update's metrics,
skips a step whose metrics say ``train/skipped``, and resumes from the learner's ``state_dict()`` (the algorithm's
``extra_state`` inside) bit for bit. The check runs exactly that on the built-in ``tiny`` policy (or the policy
given), on a small scored batch.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from palestra.testing.compare import first_difference
from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract
from palestra.testing.samples import SEED, TINY_POLICY, experience, train_config

__all__ = ["RULES", "check_optimizer"]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the algorithm from the options given",
    "protocol": (
        "it subclasses palestra.Algorithm; name is a str; needs_reference, needs_value_head, routes_agents and"
        " shared_update_window are bools; refill_rounds is an int >= 0; bind, advantages, loss, groups_short,"
        " extra_state and load_extra_state exist"
    ),
    "setup runs": "Learner(algorithm, policy, TrainContext, reference=...) binds a tiny policy without raising",
    "prepare fills advantages": (
        "the learner's prepare(batch) returns the batch with finite float advantages of shape "
        "[B] or [B, T], and it still validates"
    ),
    "update runs": "the learner's update(batch) (the algorithm's loss on the policy's scores) returns without raising",
    "metrics are floats": "update returns a dict of str -> finite Python float (not tensors)",
    "parameters change": "an update changes the policy's parameters",
    "NaN loss skips the step": (
        "with a NaN loss update returns train/skipped = 1.0, leaves "
        "every parameter as it was, and the next update is finite"
    ),
    "state round-trip": (
        "state_dict() saves with torch.save, and a fresh optimiser "
        "on a fresh policy, loaded from it, continues bit for bit"
    ),
}


def check_optimizer(
    optimizer: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    policy: str | Callable[..., Any] = "tiny",
    policy_options: Mapping[str, Any] | None = None,
    train: Mapping[str, Any] | None = None,
) -> None:
    """Check a registered optimiser (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    ``policy`` is what it trains (default: the built-in ``tiny`` policy, ~10k parameters); ``train`` overrides
    the small ``train`` section the check uses (2 tasks x 2 completions, lr 1e-2).
    """
    from palestra.context import TrainContext

    subj = subject("optimizer", optimizer, options, name=name)
    c = Contract("optimizer", subj.label, RULES)
    if policy_options is None and policy == "tiny":
        policy_options = TINY_POLICY
    maker = subject("policy", policy, policy_options)
    config = train_config(train)
    context = TrainContext.local(config)
    rows = config.batch_size * config.group_size

    model, learner = _setup(subj, maker, c, context)
    before = _weights(model)
    _update(learner, experience(model, rows=rows, group_size=config.group_size, seed=SEED), c)
    c.require(
        first_difference(before, _weights(model)) is not None,
        "update",
        "parameters change",
        "no parameter of the policy changed after an update with non-zero advantages",
    )
    _check_round_trip(learner, model, subj, maker, c, context, rows, config.group_size)
    _check_nan_loss(learner, model, c, rows, config.group_size)


def _setup(subj: Subject, maker: Subject, c: Contract, context: Any) -> tuple[Any, Any]:
    """The algorithm built and checked against the protocol, and a learner around it on a fresh policy."""
    from palestra.engine.learner import Learner

    with c.calling("build", "builds from its options"):
        algo = subj.make()
    _check_protocol(algo, c)
    model = maker.make()
    reference = copy.deepcopy(model).eval() if algo.needs_reference else None
    with c.calling("setup", "setup runs"):
        learner = Learner(algo, model, context, reference=reference)
    return model, learner


def _check_protocol(algo: Any, c: Contract) -> None:
    from palestra.engine.algorithm import Algorithm

    c.require(
        isinstance(algo, Algorithm),
        "Algorithm",
        "protocol",
        f"{type(algo).__name__} does not subclass palestra.Algorithm (the learner calls its hooks)",
    )
    c.require(
        isinstance(getattr(algo, "name", None), str),
        "name",
        "protocol",
        f"name is {getattr(algo, 'name', None)!r}; expected a str",
    )
    for flag in ("needs_reference", "needs_value_head", "routes_agents", "shared_update_window"):
        value = getattr(algo, flag, None)
        c.require(isinstance(value, bool), flag, "protocol", f"{flag} is {value!r}; expected a bool")
    rounds = getattr(algo, "refill_rounds", None)
    c.require(
        isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 0,
        "refill_rounds",
        "protocol",
        f"refill_rounds is {rounds!r}; expected an int >= 0",
    )
    for method in ("bind", "advantages", "loss", "groups_short", "extra_state", "load_extra_state"):
        c.require(callable(getattr(algo, method, None)), method, "protocol", f"has no {method}() method")


def _update(learner: Any, batch: Any, c: Contract, *, poison: bool = False) -> tuple[Any, dict[str, float]]:
    """The learner's ``prepare`` then ``update``, checking both; ``poison`` makes the loss NaN (NaN advantages) in
    between."""
    import torch

    rows = batch.batch_size
    with c.calling("prepare", "prepare fills advantages"):
        prepared = learner.prepare(batch)
    c.require(
        prepared is not None and hasattr(prepared, "advantages"),
        "prepare",
        "prepare fills advantages",
        f"returned {type(prepared).__name__}; expected the Experience",
    )
    adv = prepared.advantages
    t = prepared.completion_ids.shape[1]
    ok = isinstance(adv, torch.Tensor) and adv.is_floating_point() and tuple(adv.shape) in ((rows,), (rows, t))
    c.require(
        ok,
        "prepare",
        "prepare fills advantages",
        f"advantages are {_describe(adv)}; expected floats of shape [{rows}] or [{rows}, {t}]",
    )
    c.require(bool(torch.isfinite(adv).all()), "prepare", "prepare fills advantages", "some advantages are not finite")
    with c.calling("prepare", "prepare fills advantages"):
        prepared.validate()
    if poison:
        prepared.advantages = torch.full_like(adv, math.nan)
    # The skip warning a NaN loss makes is the expected outcome here, not news for the test's output.
    quiet = _logging_off() if poison else contextlib.nullcontext()
    with quiet, c.calling("update", "update runs"):
        metrics = learner.update(prepared)
    c.require(
        isinstance(metrics, dict),
        "update",
        "metrics are floats",
        f"returned {_describe(metrics)}; expected a dict of str -> float",
    )
    for key, value in metrics.items():
        good = isinstance(key, str) and isinstance(value, float) and (poison or math.isfinite(value))
        c.require(
            good, "update", "metrics are floats", f"metric {key!r} is {_describe(value)}; expected a finite float"
        )
    return prepared.advantages.detach().clone(), metrics


def _check_round_trip(
    learner: Any, model: Any, subj: Subject, maker: Subject, c: Contract, context: Any, rows: int, group_size: int
) -> None:
    import torch

    with c.calling("state_dict", "state round-trip"):
        state = copy.deepcopy(learner.state_dict())
    try:
        torch.save(state, io.BytesIO())
    except Exception as e:
        raise c.fail(
            "state_dict", "state round-trip", f"torch.save cannot write the state: {type(e).__name__}: {e}"
        ) from e
    # As the trainer resumes: a fresh policy, algorithm and learner, then the saved weights and state loaded.
    fresh_model, fresh = _setup(subj, maker, c, context)
    fresh_model.load_state_dict(copy.deepcopy(model.state_dict()))
    with c.calling("load_state_dict", "state round-trip"):
        fresh.load_state_dict(copy.deepcopy(state))
    batch = experience(model, rows=rows, group_size=group_size, seed=SEED + 1)
    torch.manual_seed(SEED)  # the trainer restores the global RNG too; the same draws for both
    adv_a, metrics_a = _update(learner, copy.deepcopy(batch), c)
    torch.manual_seed(SEED)
    adv_b, metrics_b = _update(fresh, copy.deepcopy(batch), c)
    for what, a, b in (
        ("advantages", adv_a, adv_b),
        ("metrics", _untimed(metrics_a), _untimed(metrics_b)),
        ("parameters", _weights(model), _weights(fresh_model)),
    ):
        found = first_difference(a, b, what)
        c.require(
            found is None,
            "load_state_dict",
            "state round-trip",
            f"a fresh learner loaded from state_dict() continues differently: {found}",
        )


def _check_nan_loss(learner: Any, model: Any, c: Contract, rows: int, group_size: int) -> None:
    import torch

    before = _weights(model)
    _, metrics = _update(learner, experience(model, rows=rows, group_size=group_size, seed=SEED + 2), c, poison=True)
    c.require(
        metrics.get("train/skipped") == 1.0,
        "update",
        "NaN loss skips the step",
        f"a NaN loss returned train/skipped={metrics.get('train/skipped')!r}; expected 1.0",
    )
    found = first_difference(before, _weights(model), "parameters")
    c.require(found is None, "update", "NaN loss skips the step", f"a skipped step changed the policy: {found}")
    _update(learner, experience(model, rows=rows, group_size=group_size, seed=SEED + 3), c)
    finite = all(bool(torch.isfinite(w).all()) for w in _weights(model).values())
    c.require(finite, "update", "NaN loss skips the step", "the update after a skipped step left non-finite parameters")


@contextlib.contextmanager
def _logging_off() -> Iterator[None]:
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _weights(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]
