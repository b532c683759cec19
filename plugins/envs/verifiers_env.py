"""Built-in environment and reward ``verifiers``: any installed `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_
environment package (its ``verifiers.v1`` stack: a ``Taskset`` of ``Task`` rows scored by weighted ``@vf.reward``
functions), trained like a native environment.

Needs the optional package: ``pip install "palestra[verifiers]"``, plus the environment's own package (``pip install
vf-reverse-word``, or ``prime env install owner/name``). Importing this module does not import verifiers.

**Loading.** ``env_id`` is the environment's id as verifiers knows it (``vf-reverse-word``, or a hub id
``owner/vf-reverse-word@0.1``): verifiers imports the installed module of that name (``vf_reverse_word``) and takes
the ``Taskset`` (and, when the package exports one, the ``Env``) its ``__all__`` names. ``env_args`` are the
taskset's config fields (``num_tasks: 50``); ``env_config`` are the environment's own config fields (a multi-turn
env's ``max_guesses``). A package that is not installed, fails to import, rejects its arguments or fails to load its
tasks is one line naming ``environment.options.env_id`` or ``.env_args``.

**Tasks.** The taskset's tasks are read once, in the taskset's own order (``num_examples`` keeps the first ones; an
infinite taskset needs it). The last ``eval_examples`` of them are held out: ``split: eval`` draws only those.
``reset(n, seed=s)`` draws ``n`` tasks with ``random.Random(s)`` (distinct while they last), each repeated
``group_size`` times. The first observation is the task's system prompt and prompt as chat messages; the metadata
carries ``answer`` (when the task data has one, so ``correctness`` also works), ``task`` (the task data as JSON) and
``verifiers`` (where the task came from, which the reward and the ``verifiers`` agent read).

**Single-turn tasks** (the taskset's own ``SingleAgentEnv`` and no tools) need nothing more: the completion is the
model's one reply (``stop`` adds stop strings). **Tool and multi-turn environments** run as verifiers rollouts
against Palestra's rollout endpoint, through the ``verifiers`` agent (``agent: {name: verifiers}``, see
:mod:`palestra.plugins.envs._verifiers_rollout`): the package's toolsets answer the model's tool calls (parsed by the
``agent.tool_parser``), its ``Env.run`` plays its user turns, and the agent hands verifiers' scores of the whole
conversation to the reward. The reward refuses to score such a task's rows without the agent (one line) rather
than score a partial conversation; an agent that failed scores 0 on every reward function.

**The reward** ``verifiers`` runs the task's own scoring (``Task.score``: every ``@vf.reward`` function and plugged
reward, each with its weight) on the finished conversation: the score is verifiers' weighted sum, each reward
function is a component under its own name (unweighted, as ``weighted_sum`` reports its terms) and its weight is
the metric ``weight/<name>``; ``@vf.metric`` values are metrics (batch means). A reward function that raises scores
its row 0 (counted in ``score_errors``, one warning naming the function).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, option
from palestra.plugins.envs._episodes import single_turn_step
from palestra.registry import MissingDependency, Requires
from palestra.types import Message, Observation, RewardOutput, StepResult

MODULE = "verifiers"
INSTALL_HINT = 'pip install "palestra[verifiers]"'
WHERE = "environment.options"
META_KEY = "verifiers"  # metadata["verifiers"]: {"env": <spec key>, "index": <task index>, "needs_agent": bool}
RESULT_KEY = "verifiers_result"  # metadata an agent rollout adds: {"rewards": {name: [score, weight]}, "metrics"...}

log = logging.getLogger("palestra.plugins.envs.verifiers_env")


def import_verifiers() -> Any:
    """``verifiers.v1``, or a one-line :class:`~palestra.MissingDependency` naming the extra to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise MissingDependency("the verifiers environment", MODULE, INSTALL_HINT, cause=e) from None
    return vf


@dataclass
class VerifiersOptions:
    env_id: str = ""  # the installed verifiers environment (required), e.g. vf-reverse-word or owner/name@version
    env_args: dict[str, Any] = field(default_factory=dict)  # the taskset's config fields
    env_config: dict[str, Any] = field(default_factory=dict)  # the environment's own config fields
    num_examples: int | None = option(None, ge=1)  # keep the taskset's first N tasks (required if it is infinite)
    eval_examples: int = option(0, ge=0)  # hold out the last N of them
    split: Literal["train", "eval"] = "train"  # which tasks reset() draws
    stop: list[str] = field(default_factory=list)  # stop strings for every completion, e.g. ["</answer>"]
    agent_id: str = "assistant"

    def __post_init__(self) -> None:
        if not self.env_id.strip():
            raise OptionError("env_id", "required: the id of an installed verifiers environment, e.g. vf-reverse-word")
        if "id" in self.env_args:
            raise OptionError("env_args", "must not set 'id' (env_id names the environment)")
        if any(not s for s in self.stop):
            raise OptionError("stop", "stop strings must not be empty")
        if "taskset" in self.env_config:
            raise OptionError("env_config", "must not set 'taskset' (env_id and env_args describe it)")

    def spec(self) -> dict[str, Any]:
        """What decides the loaded tasks: the key the reward and the agent find them by (JSON, so it travels)."""
        return {
            "env_id": self.env_id,
            "env_args": self.env_args,
            "env_config": self.env_config,
            "num_examples": self.num_examples,
        }


@dataclass
class LoadedEnv:
    """One loaded verifiers environment: the ``vf.Env`` and its tasks, in the taskset's order."""

    key: str
    env_id: str
    env: Any  # verifiers.v1.Env
    tasks: list[Any]  # verifiers.v1.Task, task.data.idx == position
    needs_agent: bool  # tools or its own Env.run: the episode is a verifiers rollout, not one reply


_LOADED: dict[str, LoadedEnv] = {}  # spec key -> environment, so the reward and the agent share the env's tasks


def spec_key(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, default=repr)


def loaded_env(key: str) -> LoadedEnv:
    """The environment a metadata key names: loaded once per process (a reward in another process reloads it)."""
    if key not in _LOADED:
        _LOADED[key] = _load(json.loads(key), key)
    return _LOADED[key]


def _load(spec: Mapping[str, Any], key: str) -> LoadedEnv:
    vf = import_verifiers()
    env_id = spec["env_id"]
    raw = {**dict(spec["env_config"]), "taskset": {**dict(spec["env_args"]), "id": env_id}}
    env = _build_env(vf, env_id, raw)
    tasks = _read_tasks(env, env_id, spec["num_examples"])
    from verifiers.v1.envs.single_agent import SingleAgentEnv

    task_cls = type(env.taskset).task_type()
    needs_agent = type(env) is not SingleAgentEnv or bool(task_cls.toolsets(env.taskset.config.task))
    return LoadedEnv(key, env_id, env, tasks, needs_agent)


def _build_env(vf: Any, env_id: str, raw: dict[str, Any]) -> Any:
    import importlib.util

    from pydantic import ValidationError

    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # as verifiers names it
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found and importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") is None:
        raise ConfigError(
            f"{WHERE}.env_id: verifiers environment {env_id!r} is not installed (no module {module!r}); install "
            f"its package (pip install {module.replace('_', '-')}, or prime env install <owner>/{env_id})"
        )
    try:
        vf.import_taskset(env_id)
    except Exception as e:  # noqa: BLE001 - any error importing a third-party package is that package's fault
        cause = e.__cause__ if isinstance(e.__cause__, ImportError) else e
        raise ConfigError(
            f"{WHERE}.env_id: verifiers environment {env_id!r} fails to import: {_one_line(cause)}"
        ) from None
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except ValidationError as e:
        key = "env_args" if all(err.get("loc", ("",))[0] == "taskset" for err in e.errors()) else "env_config"
        raise ConfigError(f"{WHERE}.{key}: verifiers environment {env_id!r} rejects them: {_pydantic(e)}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{WHERE}.env_id: verifiers environment {env_id!r} cannot be built: {_one_line(e)}") from None


def _read_tasks(env: Any, env_id: str, num_examples: int | None) -> list[Any]:
    taskset = env.taskset
    if num_examples is not None:
        taskset = taskset.take(num_examples)
    elif not taskset.bounded:
        raise ConfigError(f"{WHERE}.num_examples: verifiers environment {env_id!r} has an endless taskset; set it")
    try:
        tasks = list(taskset)
    except Exception as e:  # noqa: BLE001 - the package's own load() failing is one line naming it
        raise ConfigError(
            f"{WHERE}.env_args: verifiers environment {env_id!r} failed to load its tasks: {_one_line(e)}"
        ) from None
    if not tasks:
        raise ConfigError(f"{WHERE}.env_args: verifiers environment {env_id!r} loaded no tasks")
    return tasks


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _pydantic(e: Any) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "taskset")
        parts.append(f"{where}: {err.get('msg', '')}" if where else str(err.get("msg", "")))
    return "; ".join(parts) or _one_line(e)


# ---- prompts -----------------------------------------------------------------------------------------
def prompt_messages(task: Any) -> list[Any]:
    """The task's opening conversation as verifiers messages: its system prompt, then its prompt."""
    vf = import_verifiers()
    data = task.data
    out: list[Any] = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        out.extend(data.prompt)
    return out


def task_fields(task: Any) -> dict[str, Any]:
    """The task's own data fields (its TaskData subclass's, plus prompt and ids) as JSON: what a reward may read;
    verifiers' sandbox fields (image, resources, network rules ...) are left out."""
    vf = import_verifiers()
    own = set(type(task.data).model_fields) - set(vf.TaskData.model_fields)
    return task.data.model_dump(mode="json", exclude_none=True, include=own | {"idx", "id", "name", "prompt"})


def as_palestra(message: Any) -> Message:
    from verifiers.v1.types import content_text

    return Message(message.role, content_text(message.content) if message.content is not None else "")


# ---- the environment ---------------------------------------------------------------------------------
class VerifiersEnv:
    """An installed verifiers environment's tasks, one per episode. See the module docstring."""

    max_turns = 1

    def __init__(self, **options: Any) -> None:
        self.options: VerifiersOptions = check_options(VerifiersOptions, options, where="verifiers")
        o = self.options
        self.agent_ids = (o.agent_id,)
        self.key = spec_key(o.spec())
        self.loaded = loaded_env(self.key)
        self.needs_agent = self.loaded.needs_agent
        held = min(o.eval_examples, len(self.loaded.tasks))
        if held and held >= len(self.loaded.tasks):
            raise ConfigError(
                f"{WHERE}.eval_examples: holds out {held} of the {len(self.loaded.tasks)} tasks, leaving none to "
                "train on"
            )
        cut = len(self.loaded.tasks) - held
        self.train_tasks, self.eval_tasks = self.loaded.tasks[:cut], self.loaded.tasks[cut:]
        self.pool = self.eval_tasks if o.split == "eval" and self.eval_tasks else self.train_tasks
        self._rng = random.Random()
        self._rows: list[Any] = []
        self._live: list[bool] = []

    def held_out(self) -> VerifiersEnv:
        """The same environment over the held-out tasks (``split: eval``)."""
        from dataclasses import asdict

        return VerifiersEnv(**{**asdict(self.options), "split": "eval"})

    def observation(self, task: Any) -> Observation:
        messages = [as_palestra(m) for m in prompt_messages(task)]
        data = task_fields(task)
        metadata: dict[str, Any] = {
            "task": data,
            META_KEY: {"env": self.key, "index": task.data.idx, "needs_agent": self.needs_agent},
        }
        if "answer" in data:
            metadata["answer"] = data["answer"] if isinstance(data["answer"], str) else json.dumps(data["answer"])
        return Observation(
            prompt="\n\n".join(m.content for m in messages),
            agent_id=self.options.agent_id,
            messages=messages,
            metadata=metadata,
            stop=list(self.options.stop) or None,
        )

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        for name, value in (("batch_size", batch_size), ("group_size", group_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"verifiers.reset: {name} must be a positive integer, got {value!r}")
        rng = random.Random(seed) if seed is not None else self._rng
        picks: list[Any] = []
        while len(picks) < batch_size:
            picks += rng.sample(self.pool, min(batch_size - len(picks), len(self.pool)))
        self._rows = [t for t in picks for _ in range(group_size)]
        self._live = [True] * len(self._rows)
        return [self.observation(t) for t in self._rows]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        expected = [str(t.data.model_dump().get("answer", "")) for t in self._rows]
        result = single_turn_step("verifiers", actions, self._live, self.options.agent_id, expected)
        self._live = [False] * len(self._rows)
        return result


# ---- scoring -----------------------------------------------------------------------------------------
def build_trace(task: Any, turns: Sequence[tuple[Any, bool]], tools: Sequence[Any] = ()) -> Any:
    """A verifiers ``Trace`` of one conversation: ``turns`` are (verifiers message, sampled by the model) pairs,
    each node the child of the one before (one branch), as verifiers' interception records a rollout."""
    vf = import_verifiers()
    from verifiers.v1.graph import MessageNode

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        tools=list(tools),
    )
    for i, (message, sampled) in enumerate(turns):
        trace.nodes.append(MessageNode(parent=i - 1 if i else None, message=message, sampled=sampled))
    return trace


@dataclass
class Scored:
    """A finished trace's verifiers scores: ``rewards`` name -> (score, weight); ``metrics`` name -> value."""

    rewards: dict[str, tuple[float, float]]
    metrics: dict[str, float]
    error: str | None = None  # why scoring failed (then every reward is 0)

    @property
    def total(self) -> float:
        return sum(score * weight for score, weight in self.rewards.values())

    def as_metadata(self) -> dict[str, Any]:
        return {"rewards": {k: list(v) for k, v in self.rewards.items()}, "metrics": self.metrics, "error": self.error}

    @staticmethod
    def from_metadata(value: Mapping[str, Any]) -> Scored:
        rewards = {str(k): (float(v[0]), float(v[1])) for k, v in dict(value.get("rewards", {})).items()}
        return Scored(
            rewards, {str(k): float(v) for k, v in dict(value.get("metrics", {})).items()}, value.get("error")
        )


def failed(task: Any, why: str) -> Scored:
    """Every reward of ``task`` at 0 (their weights kept): a row whose scoring or whose agent failed."""
    return Scored({fn.__name__: (0.0, float(getattr(fn, "_vf_weight", 1.0))) for fn in task.hooks("reward")}, {}, why)


async def score_trace(task: Any, trace: Any) -> Scored:
    """``task.score(trace)`` (verifiers' own scoring, no runtime) as plain numbers; a failing function scores 0."""
    try:
        await task.score(trace)
    except Exception as e:  # noqa: BLE001 - a package's reward function failing is a zero for that row, not a crash
        return failed(task, _one_line(e))
    rewards = {name: (float(r.score), float(r.weight)) for name, r in trace.rewards.items() if r is not None}
    metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None}
    return Scored(rewards, metrics)


async def score_replies(tasks: Sequence[Any], completions: Sequence[str]) -> list[Scored]:
    """Score single-turn episodes (each task's prompt and the model's one reply), concurrently as verifiers does."""
    vf = import_verifiers()

    def trace(task: Any, completion: str) -> Any:
        turns = [(m, False) for m in prompt_messages(task)]
        return build_trace(task, [*turns, (vf.AssistantMessage(content=completion), True)])

    return list(await asyncio.gather(*(score_trace(t, trace(t, c)) for t, c in zip(tasks, completions))))


@dataclass
class VerifiersRewardOptions:
    pass


class VerifiersReward:
    """The verifiers task's own weighted rewards (see the module docstring)."""

    def __init__(self, **options: Any) -> None:
        self.options: VerifiersRewardOptions = check_options(VerifiersRewardOptions, options, where="verifiers")
        import_verifiers()  # fail when the run is built, not at the first score
        self._warned: set[str] = set()

    def task_of(self, meta: Mapping[str, Any]) -> Any:
        """The verifiers task a row played; None when an agent already scored its rollout; a zero :class:`Scored`
        when its agent failed."""
        where = meta.get(META_KEY)
        if not isinstance(where, Mapping) or "env" not in where:
            raise KeyError(
                f"metadata has no {META_KEY!r}; the verifiers reward scores rows of the verifiers environment "
                f"(this row's metadata has {sorted(meta)})"
            )
        if isinstance(meta.get(RESULT_KEY), Mapping):
            return None
        env = loaded_env(str(where["env"]))
        info = meta.get("info")
        if isinstance(info, Mapping) and "agent_answer" in info:  # an agent episode that returned no result
            return failed(
                env.tasks[int(where["index"])], str(info.get("agent_error") or "the agent returned no result")
            )
        if env.needs_agent:
            raise ConfigError(
                f"reward verifiers: verifiers environment {env.env_id!r} runs tool or multi-turn episodes; "
                "add `agent: {name: verifiers}` to the config so they run as verifiers rollouts"
            )
        return env.tasks[int(where["index"])]

    def rows(self, completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> list[Scored]:
        tasks = [self.task_of(m) for m in metadata]
        todo = [i for i, t in enumerate(tasks) if t is not None and not isinstance(t, Scored)]
        scored = asyncio.run(score_replies([tasks[i] for i in todo], [completions[i] for i in todo])) if todo else []
        out = [
            Scored.from_metadata(m[RESULT_KEY]) if t is None else t if isinstance(t, Scored) else None
            for t, m in zip(tasks, metadata)
        ]
        for i, s in zip(todo, scored):
            out[i] = s
        return [s for s in out if s is not None]

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        import torch

        rows = self.rows(completions, metadata)
        names = list(dict.fromkeys(name for r in rows for name in r.rewards))
        components = {
            n: torch.tensor([r.rewards.get(n, (0.0, 0.0))[0] for r in rows], dtype=torch.float32) for n in names
        }
        metrics: dict[str, float] = {}
        for n in names:
            metrics[f"weight/{n}"] = next(r.rewards[n][1] for r in rows if n in r.rewards)
        for n in dict.fromkeys(k for r in rows for k in r.metrics):
            values = [r.metrics[n] for r in rows if n in r.metrics]
            metrics[f"metric/{n}"] = sum(values) / len(values)
        errors = [r.error for r in rows if r.error]
        for e in errors:
            if e not in self._warned:
                self._warned.add(e)
                log.warning("verifiers reward: a row scores 0: %s", e)
        metrics["score_errors"] = float(len(errors))
        scores = torch.tensor([r.total for r in rows], dtype=torch.float32)
        return RewardOutput(scores=scores, components=components, metrics=metrics)

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        """Held-out scoring is the same call: the reward keeps no state."""
        return self(prompts, completions, metadata)


# ---- the agent ---------------------------------------------------------------------------------------
@dataclass
class VerifiersAgentOptions:
    max_turns: int = option(8, ge=1)  # model calls per agent run (verifiers' max_turns stop)
    max_tokens: int | None = option(None, ge=1)  # per model call (the trainer's max_new_tokens caps it too)
    temperature: float | None = option(None, ge=0)  # None: the trainer's sampling temperature


class VerifiersAgent:
    """Runs the verifiers environment's own episode (its tools, its ``run()``) against Palestra's rollout endpoint
    and returns the scored result: the answer is the scored trace's last reply, and ``metadata["verifiers_result"]``
    carries verifiers' rewards (with weights) and metrics, which the ``verifiers`` reward reports."""

    def __init__(self, **options: Any) -> None:
        self.options: VerifiersAgentOptions = check_options(VerifiersAgentOptions, options, where="verifiers")
        import_verifiers()

    async def rollout(self, client: Any, task: Any) -> Any:
        from palestra.agents.api import AgentResult
        from palestra.plugins.envs._verifiers_rollout import Limits, run_episode

        where = task.metadata.get(META_KEY)
        if not isinstance(where, Mapping) or "env" not in where:
            raise KeyError(
                f"the verifiers agent plays tasks of the verifiers environment; this task's metadata has no "
                f"{META_KEY!r} (environment: set environment.name to verifiers)"
            )
        o = self.options
        limits = Limits(max_turns=o.max_turns, max_tokens=o.max_tokens, temperature=o.temperature)
        outcome = await run_episode(client, task.model, loaded_env(str(where["env"])), int(where["index"]), limits)
        return AgentResult(answer=outcome.answer, metadata={RESULT_KEY: outcome.metadata()})


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "verifiers",
        Requires(VerifiersEnv, module=MODULE, install=INSTALL_HINT),
        options=VerifiersOptions,
        description="an installed verifiers environment package (its taskset's tasks; tools and multi-turn via the "
        "verifiers agent)",
    )


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "verifiers",
        Requires(VerifiersReward, module=MODULE, install=INSTALL_HINT),
        options=VerifiersRewardOptions,
        description="the verifiers task's own weighted reward functions (each a component with its weight)",
    )


@hookimpl
def register_agents(register: Any) -> None:
    register(
        "verifiers",
        Requires(VerifiersAgent, module=MODULE, install=INSTALL_HINT),
        options=VerifiersAgentOptions,
        description="runs the verifiers environment's own episodes (tools, multi-turn) against the rollout endpoint",
    )
