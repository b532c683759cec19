"""Built-in environment and reward ``reasoning_gym``: the procedurally generated tasks of the
`reasoning-gym <https://pypi.org/project/reasoning-gym/>`_ package (arithmetic, algebra, logic, games, ...), each
scored by the task's own ``score_answer``.

Needs the optional package: ``pip install "palestra[reasoning-gym]"``. Importing this module does not import
reasoning_gym; both components are registered through :class:`palestra.registry.Requires`, so without the package
``palestra plugins --all`` lists them as unavailable with that command, and naming one in a config is one line
saying how to install it.

**Tasks.** ``task: basic_arithmetic`` (any name ``reasoning_gym.create_dataset`` knows), or a weighted mix
``tasks: {basic_arithmetic: 2, leg_counting: 1}`` (reasoning_gym's composite dataset: each entry's task drawn by
weight). ``task_options: {basic_arithmetic: {max_terms: 3}}`` passes keyword arguments to a task's dataset config.

**Seeds and the held-out split.** Training entries are the ``size`` entries of the data set generated with
``seed``; ``reset(n, seed=s)`` picks ``n`` of them with ``random.Random(s)`` (the trainer's seeds come from the run
seed). The held-out split is ``eval_size`` entries generated with ``eval_seed`` (default ``seed + size + number of
tasks + 1``): reasoning_gym generates entry ``i`` of a data set seeded ``S`` from ``Random(S + i)`` (a mix's j-th
task from ``S + j + 1 + i``), so no held-out entry shares a generator seed with a training entry. (Tasks with few
possible questions can still repeat a question by chance.) ``split: eval`` draws the held-out entries; so does
:meth:`ReasoningGymEnv.held_out`.

**Prompt and metadata.** ``prompt`` formats ``{question}`` (the entry's question) and ``{tag}`` (``answer_tag``);
the default asks for the answer in ``<answer></answer>``. The metadata carries ``answer`` (so ``correctness``
works too), ``question``, ``task``, ``task_options`` (that task's) and ``entry`` (the whole reasoning_gym entry),
which is what the ``reasoning_gym`` reward hands to the task's ``score_answer(answer, entry)``.
"""

from __future__ import annotations

import difflib
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, format_fields, option
from palestra.plugins.envs._episodes import single_turn_step
from palestra.plugins.rewards.basic import extract_tag
from palestra.registry import MissingDependency, Requires
from palestra.types import Message, Observation, RewardOutput, StepResult

MODULE = "reasoning_gym"
INSTALL_HINT = 'pip install "palestra[reasoning-gym]"'
WHERE = "environment.options"
DEFAULT_TASK = "basic_arithmetic"
PROMPT_FIELDS = ("question", "tag")
_SET_BY_ENVIRONMENT = ("seed", "size")  # task_options may not set these: seed, size and eval_seed decide them


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or a one-line :class:`~palestra.MissingDependency` naming the extra to install."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingDependency("the reasoning_gym environment", MODULE, INSTALL_HINT, cause=e) from None
    return reasoning_gym


@dataclass
class ReasoningGymOptions:
    task: str | None = None  # one reasoning_gym task; null and no tasks: basic_arithmetic
    tasks: dict[str, float] = field(default_factory=dict)  # instead: a weighted mix, task name -> weight (> 0)
    task_options: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # task name -> its dataset config's keyword arguments
    size: int = option(10_000, ge=1)  # training entries
    seed: int = 0  # the training entries' generator seed
    eval_size: int = option(200, ge=1)  # held-out entries
    eval_seed: int | None = None  # the held-out entries' seed; null: seed + size + number of tasks + 1 (disjoint)
    split: Literal["train", "eval"] = "train"  # which entries reset() draws
    prompt: str = "{question}\n\nPut only the final answer in <{tag}></{tag}>."
    answer_tag: str = "answer"
    system_prompt: str | None = None
    agent_id: str = "assistant"

    def __post_init__(self) -> None:
        if self.task is not None and self.tasks:
            raise OptionError("task", "set task or tasks (a weighted mix), not both")
        if self.task is not None and not self.task.strip():
            raise OptionError("task", "must name a reasoning_gym task such as 'basic_arithmetic', got ''")
        for name, weight in self.tasks.items():
            if not weight > 0:
                raise OptionError(f"tasks.{name}", f"weights must be > 0, got {weight!r}")
        # whether each task_options name is one of the tasks is checked when the data set is made, after the tasks
        # themselves are known to exist: a misspelt task is the mistake to name, not the options left without it
        for name, config in self.task_options.items():
            for key in _SET_BY_ENVIRONMENT:
                if key in config:
                    raise OptionError(
                        f"task_options.{name}.{key}",
                        "is set by the environment; use seed, size, eval_seed and eval_size",
                    )
        fields = format_fields("prompt", self.prompt)
        for f in fields:
            if f not in PROMPT_FIELDS:
                raise OptionError("prompt", f"unknown field {{{f}}}; the fields are {{question}} and {{tag}}")
        if "question" not in fields:
            raise OptionError("prompt", "must contain {question}")
        if not self.answer_tag.replace("_", "").replace("-", "").isalnum():
            raise OptionError("answer_tag", f"must be a tag name such as 'answer', got {self.answer_tag!r}")

    @property
    def task_names(self) -> list[str]:
        return list(self.tasks) if self.tasks else [self.task or DEFAULT_TASK]


def make_dataset(rg: Any, o: ReasoningGymOptions, *, seed: int, size: int) -> Any:
    """The reasoning_gym data set the options describe (one task, or the composite of the mix)."""
    known = rg.factory.DATASETS
    for name in o.task_names:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            hint = (
                f"; did you mean {', '.join(map(repr, close))}?"
                if close
                else f"; see reasoning_gym.factory.DATASETS ({len(known)} tasks)"
            )
            key = f"tasks.{name}" if o.tasks else "task"
            raise ConfigError(f"{WHERE}.{key}: unknown reasoning_gym task {name!r}{hint}")
    for name in o.task_options:
        if name not in o.task_names:
            raise ConfigError(
                f"{WHERE}.task_options.{name}: {name!r} is not one of the tasks ({', '.join(o.task_names)})"
            )
    if not o.tasks:
        name = o.task_names[0]
        return _create(rg, name, dict(o.task_options.get(name, {})), f"task_options.{name}", seed=seed, size=size)
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name, float(w), dict(o.task_options.get(name, {}))) for name, w in o.tasks.items()]
    return _create(rg, "composite", {"datasets": specs}, "task_options", seed=seed, size=size)


def _create(rg: Any, name: str, config: dict[str, Any], key: str, *, seed: int, size: int) -> Any:
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError, KeyError) as e:  # reasoning_gym validates configs with asserts
        text = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{WHERE}.{key}: reasoning_gym rejects the task options: {text}") from None


def plain(value: Any) -> Any:
    """An entry's value as plain data (tuples to lists, sets sorted), so that metadata pickles and compares anywhere."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    return value


class ReasoningGymEnv:
    """reasoning_gym questions, one per episode. See the module docstring and :class:`palestra.types.Environment`."""

    max_turns = 1

    def __init__(self, **options: Any) -> None:
        self.options: ReasoningGymOptions = check_options(ReasoningGymOptions, options, where="reasoning_gym")
        o = self.options
        rg = import_reasoning_gym()
        self.agent_ids = (o.agent_id,)
        eval_seed = o.eval_seed if o.eval_seed is not None else o.seed + o.size + len(o.task_names) + 1
        self.train_data = make_dataset(rg, o, seed=o.seed, size=o.size)
        eval_data = make_dataset(rg, o, seed=eval_seed, size=o.eval_size)
        self.eval_entries = [eval_data[i] for i in range(o.eval_size)]  # a few hundred: generated once, up front
        self._rng = random.Random()
        self._entries: list[dict[str, Any]] = []
        self._live: list[bool] = []

    def held_out(self) -> ReasoningGymEnv:
        """The same environment over the held-out entries (``split: eval``); training never draws them."""
        return ReasoningGymEnv(**{**asdict(self.options), "split": "eval"})

    def draw(self, n: int, rng: random.Random) -> list[dict[str, Any]]:
        """``n`` entries of the split: distinct while the split lasts, then another shuffled pass."""
        pool = self.options.size if self.options.split == "train" else len(self.eval_entries)
        picks: list[int] = []
        while len(picks) < n:
            picks += rng.sample(range(pool), min(n - len(picks), pool))
        if self.options.split == "eval":
            return [self.eval_entries[i] for i in picks]
        return [self.train_data[i] for i in picks]

    def observation(self, entry: Mapping[str, Any]) -> Observation:
        o = self.options
        text = o.prompt.format(question=entry["question"], tag=o.answer_tag)
        task = entry["metadata"]["source_dataset"]
        messages = ([Message("system", o.system_prompt)] if o.system_prompt else []) + [Message("user", text)]
        return Observation(
            prompt=f"{o.system_prompt}\n\n{text}" if o.system_prompt else text,
            agent_id=o.agent_id,
            messages=messages,
            metadata={
                "answer": str(entry["answer"]),
                "question": entry["question"],
                "task": task,
                "task_options": plain(o.task_options.get(task, {})),
                "entry": plain(entry),
            },
            stop=[f"</{o.answer_tag}>"],  # nothing after the closing tag is read
        )

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        for name, value in (("batch_size", batch_size), ("group_size", group_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"reasoning_gym.reset: {name} must be a positive integer, got {value!r}")
        source = random.Random(seed) if seed is not None else self._rng
        self._entries = [e for e in self.draw(batch_size, source) for _ in range(group_size)]
        self._live = [True] * len(self._entries)
        return [self.observation(e) for e in self._entries]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        expected = [str(t["answer"]) for t in self._entries]
        result = single_turn_step("reasoning_gym", actions, self._live, self.options.agent_id, expected)
        self._live = [False] * len(self._entries)
        return result


# ---- the reward --------------------------------------------------------------------------------------
@dataclass
class ReasoningGymRewardOptions:
    tag: str | None = (
        "answer"  # the answer is the last <tag>...</tag> (none: score_answer gets None); null: the whole completion
    )

    def __post_init__(self) -> None:
        if self.tag is not None and not self.tag.replace("_", "").replace("-", "").isalnum():
            raise OptionError("tag", f"must be a tag name such as 'answer', got {self.tag!r}")


class ReasoningGymReward:
    """The task's own ``score_answer(answer, entry)`` for each row, in [0, 1].

    Reads ``metadata["entry"]``, ``["task"]`` and ``["task_options"]`` as the ``reasoning_gym`` environment writes
    them. A scorer that raises on a malformed answer scores it 0 (counted in ``scorer_errors``). Metrics: the
    mean score of each task in the batch (``score/<task>``).
    """

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.options: ReasoningGymRewardOptions = check_options(
            ReasoningGymRewardOptions, options, where="reasoning_gym"
        )
        import_reasoning_gym()  # fail here, when the run is built, rather than at the first score
        self._scorers: dict[tuple[str, str], Any] = {}

    def scorer(self, task: str, task_options: Mapping[str, Any]) -> Any:
        """The task's ``score_answer``, from a data set built with the same options as the environment's."""
        key = (task, json.dumps(task_options, sort_keys=True, default=repr))
        if key not in self._scorers:
            self._scorers[key] = (
                import_reasoning_gym().create_dataset(task, seed=0, size=1, **task_options).score_answer
            )
        return self._scorers[key]

    def answer(self, completion: str) -> str | None:
        tag = self.options.tag
        return completion.strip() if tag is None else extract_tag(completion, tag)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        import torch

        values: list[float] = []
        by_task: dict[str, list[float]] = {}
        errors = 0
        for completion, meta in zip(completions, metadata):
            missing = [k for k in ("entry", "task") if k not in meta]
            if missing:
                raise KeyError(
                    f"metadata has no {missing[0]!r}; the reasoning_gym reward scores rows of the reasoning_gym "
                    f"environment (this row's metadata has {sorted(meta)})"
                )
            score_answer = self.scorer(meta["task"], meta.get("task_options", {}))
            try:
                value = float(score_answer(self.answer(completion), dict(meta["entry"])))
            except Exception:  # noqa: BLE001 - the task's scorer failing on a malformed answer is a wrong answer, not a crashed run
                value, errors = 0.0, errors + 1
            value = min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0
            values.append(value)
            by_task.setdefault(str(meta["task"]), []).append(value)
        metrics = {f"score/{task}": sum(v) / len(v) for task, v in sorted(by_task.items())}
        metrics["scorer_errors"] = float(errors)
        return RewardOutput(scores=torch.tensor(values, dtype=torch.float32), metrics=metrics)

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        """Held-out scoring is the same call: the reward keeps no state (its scorer cache changes no score)."""
        return self(prompts, completions, metadata)


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "reasoning_gym",
        Requires(ReasoningGymEnv, module=MODULE, install=INSTALL_HINT),
        options=ReasoningGymOptions,
        description="reasoning_gym's generated tasks (one, or a weighted mix) with a held-out split from its own seed",
    )


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "reasoning_gym",
        Requires(ReasoningGymReward, module=MODULE, install=INSTALL_HINT),
        options=ReasoningGymRewardOptions,
        description="the reasoning_gym task's own score_answer on the tagged answer",
    )
