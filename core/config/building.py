"""Building the run: each component from its validated config node through the plugin registry
(:func:`build_component`), and every component of a training run together (:func:`build_run`).

``config`` builds and ``engine`` runs: nothing here imports the engine, and the trainer receives what
:func:`build_run` made.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra.checked_reward import CheckedReward
from palestra.errors import ComponentBuildError, ConfigError
from palestra.registry import Registry

from .schema import SPEC_TYPES, ComponentSpec
from .validation import _ACTIVE_REGISTRY, _convert, _init_fields, _lookup, default_registry, to_plain

if TYPE_CHECKING:
    from palestra.context import TrainContext
    from palestra.scale.distributed import DistributedContext

    from .schema import Config


# The config path of the component whose factory is running: a factory that reads files (a judge model's folder) names
# its own options in errors by their full path, nested under a combinator or not (see building_path()).
_BUILDING_PATH: ContextVar[str | None] = ContextVar("palestra_building_path", default=None)


def building_path() -> str | None:
    """The config path of the component being built now (``reward.options.components[1]``); None outside a build."""
    return _BUILDING_PATH.get()


def build_component(
    kind: str, spec: ComponentSpec | Mapping[str, Any], *, path: str, registry: Registry | None = None
) -> Any:
    """Build the registered ``kind`` component that the config node ``spec`` names, with its validated options.

    ``spec`` is a validated :class:`ComponentSpec` (from :func:`load_config`) or plain ``{name, options}``
    data (validated here, errors naming ``path``). Rewards come back wrapped in
    :class:`palestra.checked_reward.CheckedReward`, so every call's output is checked. Components nested in the
    options (a combinator's terms) are built through the same registry.
    """
    if kind not in SPEC_TYPES:
        raise ConfigError(f"{path}: unknown component kind {kind!r}; the kinds are {', '.join(SPEC_TYPES)}")
    registry = registry or _ACTIVE_REGISTRY.get() or default_registry()
    token = _ACTIVE_REGISTRY.set(registry)
    try:
        if not (isinstance(spec, ComponentSpec) and spec.path and kind == spec.KIND):
            spec = _convert(to_plain(spec), SPEC_TYPES[kind], path)
        assert isinstance(spec, ComponentSpec)
        reg = _lookup(registry, kind, spec.name, path)
        opts = spec.options
        kwargs = {f.name: getattr(opts, f.name) for f in _init_fields(type(opts))} if opts is not None else {}
        building = _BUILDING_PATH.set(path)
        try:
            component = reg.factory(**kwargs)
        except ConfigError:
            raise
        except Exception as e:
            who = f"plugin {reg.plugin!r}" + (f", distribution {reg.distribution!r}" if reg.distribution else "")
            raise ComponentBuildError(
                f"{path}: building {kind} {spec.name!r} ({who}) failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            _BUILDING_PATH.reset(building)
    finally:
        _ACTIVE_REGISTRY.reset(token)
    if kind == "reward" and not isinstance(component, CheckedReward):
        component = CheckedReward(component, name=spec.name, path=path)
    return component


@dataclass(frozen=True)
class RunComponents:
    """Every component of a training run, built (:func:`build_run`); the trainer runs them, with a
    :class:`~palestra.engine.learner.Learner` over the algorithm, the policy and ``context``.

    ``eval_env`` is the environment of held-out evaluation; ``reference`` the frozen policy of a KL term (None when
    the algorithm has none); ``loggers`` is empty on every rank but 0; ``context`` what the learner is given.
    """

    config: Config
    dist: DistributedContext
    env: Any
    eval_env: Any
    reward: CheckedReward
    loggers: list[Any]
    generator: Any
    algorithm: Any
    policy: Any
    reference: Any
    context: TrainContext


def build_run(config: Config, dist: DistributedContext) -> RunComponents:
    """Build every component of a run of ``config`` on the ranks of ``dist``.

    Seeds Python's and torch's generators with ``run.seed`` first: the policy's initial weights (the same on every
    rank, broadcast besides) come from it. The cheap components come first, so that a bad environment or reward
    stops the run before a model is loaded.
    """
    import torch

    from palestra.context import TrainContext
    from palestra.kernels import set_backend
    from palestra.multiagent.sharing import wrap_policy
    from palestra.types import AdapterPolicy, HeldOutSplit

    random.seed(config.run.seed)
    torch.manual_seed(config.run.seed)
    set_backend(config.kernels.backend)
    check_agent_section(config)
    check_async_section(config)
    env = build_component("environment", config.environment, path="environment")
    # A data set's own held-out split when it keeps one; else a second instance (evaluated on held-out seeds).
    eval_env = (
        env.held_out()
        if isinstance(env, HeldOutSplit)
        else build_component("environment", config.environment, path="environment")
    )
    if config.tools is not None:  # every episode a tool-use loop, in training and in held-out evaluation alike
        env, eval_env = wrap_with_tools([env, eval_env], config)
    if config.agent is not None:  # agent code plays every episode through the rollout endpoint (one for both)
        env, eval_env = wrap_with_agent([env, eval_env], config)
    reward = build_component("reward", config.reward, path="reward")
    # Loggers live on rank 0 only: the other ranks' metrics reach it through the all-reduce.
    specs = config.loggers if dist.is_main else []
    loggers = [build_component("logger", spec, path=f"loggers[{i}]") for i, spec in enumerate(specs)]
    generator = build_component("generator", config.generator, path="generator")
    algorithm = build_component("optimizer", config.optimizer, path="optimizer")
    policy = build_component("policy", config.policy, path="policy")
    policy.to(device=dist.device, dtype=getattr(torch, config.train.dtype))
    dist.broadcast_module(policy)  # identical starting weights, however the policy was made
    # per-agent views sharing agents.shared_layers; unchanged when config.agents is None
    policy = wrap_policy(policy, config.agents, env, algorithm)
    if isinstance(policy, AdapterPolicy) and dist.fsdp:
        raise ConfigError(
            "distributed.strategy: fsdp is not supported for a policy that trains adapters (LoRA, "
            f"policy {config.policy.name!r}); use ddp: only the adapters' gradients are averaged"
        )
    reference = None
    if algorithm.needs_reference:
        # LoRA: the frozen base (the policy with its adapters disabled) is the reference; no second copy
        reference = (
            policy.base_reference()
            if isinstance(policy, AdapterPolicy)
            else copy.deepcopy(policy).eval().requires_grad_(False)
        )
    dist.shard(policy)  # FSDP2 (distributed.strategy=fsdp); a no-op otherwise
    # Everything the learner needs from the run, handed over explicitly: device, ranks, precision, gradient averaging.
    context = TrainContext.for_run(config, dist)
    return RunComponents(config, dist, env, eval_env, reward, loggers, generator, algorithm, policy, reference, context)


def build_sampling_side(config: Config, device: Any) -> tuple[Any, Any, Any]:
    """The environment, generator and policy of ``config`` on ``device``: what an asynchronous run's rollout worker
    (:mod:`palestra.engine.rollout_worker`) samples with. The policy's weights are the learner's to send: whatever
    this build initialises them to is overwritten."""
    import torch

    from palestra.kernels import set_backend

    set_backend(config.kernels.backend)
    env = build_component("environment", config.environment, path="environment")
    if config.tools is not None:
        (env,) = wrap_with_tools([env], config)
    generator = build_component("generator", config.generator, path="generator")
    policy = build_component("policy", config.policy, path="policy")
    policy.to(device=device, dtype=getattr(torch, config.train.dtype))
    return env, generator, policy


def build_tools(config: Config) -> list[Any]:
    """The tools of ``config.tools``: each entry's factory returns one Tool or a list of them; names are unique."""
    from palestra.tools import Tool

    assert config.tools is not None
    tools: list[Tool] = []
    where: dict[str, str] = {}
    for i, spec in enumerate(config.tools.tools):
        path = f"tools.tools[{i}]"
        built = build_component("tool", spec, path=path)
        for tool in built if isinstance(built, (list, tuple)) else [built]:
            if not isinstance(tool, Tool):
                raise ComponentBuildError(
                    f"{path}: tool {spec.name!r} built a {type(tool).__name__}, not a palestra.tools.Tool"
                )
            if tool.name in where:
                raise ConfigError(
                    f"{path}: a tool named {tool.name!r} is already offered by {where[tool.name]}; "
                    "tool names must be unique (rename one in its options)"
                )
            where[tool.name] = path
            tools.append(tool)
    return tools


def check_tool_timeouts(tools: list[Any], config: Config) -> None:
    """One step of the tool loop runs its rows side by side, each row's calls in turn: up to ``max_tool_calls``
    calls of the slowest tool, each until its timeout. That must fit in ``train.data_timeout_s``, or a batch of
    hanging tools would fail the run as a stalled environment instead of answering the model "timed out"."""
    assert config.tools is not None
    limit, calls = config.train.data_timeout_s, config.tools.max_tool_calls
    slowest = max(tools, key=lambda t: t.timeout_s)
    if limit is not None and calls * slowest.timeout_s >= limit:
        raise ConfigError(
            f"tools.max_tool_calls: {calls} calls of tool {slowest.name!r} (timeout_s={slowest.timeout_s:g}) may take "
            f"{calls * slowest.timeout_s:g} s in one step, not below train.data_timeout_s={limit:g}; raise "
            "train.data_timeout_s or lower tools.max_tool_calls or the tool's timeout"
        )


def wrap_with_tools(envs: list[Any], config: Config) -> list[Any]:
    """Each of ``envs`` as a tool-use loop (:class:`palestra.tools.episode.ToolUseEnvironment`) with
    ``config.tools``; the tools are built once and shared (a tool holding a server is started once)."""
    from palestra.tools.episode import ToolUseEnvironment
    from palestra.tools.runner import ToolRunner

    section = config.tools
    assert section is not None
    tools = build_tools(config)
    check_tool_timeouts(tools, config)
    runner = ToolRunner(tools, max_result_chars=section.max_result_chars)
    parser = build_component("tool_parser", section.parser, path="tools.parser")
    return [
        ToolUseEnvironment(
            env,
            runner,
            parser,
            max_tool_calls=section.max_tool_calls,
            system_prompt=section.system_prompt,
            name=config.environment.name,
        )
        for env in envs
    ]


def check_async_section(config: Config) -> None:
    """What ``train.async`` cannot run with in the config itself, before anything is built: one line each."""
    section = config.train.async_
    if section is None or not section.lag:
        return
    if config.agents is not None:
        raise ConfigError(
            "train.async: multi-agent runs (the agents: section) are synchronous only: their per-agent policy views "
            "share layers that the worker would have to rebuild; set train.async=null"
        )
    if config.agent is not None:
        raise ConfigError(
            "train.async: agent code (the agent: section) plays its episodes through the trainer's own rollout "
            "endpoint; set train.async=null"
        )


def check_agent_section(config: Config) -> None:
    """The ``agent:`` section's conflicts, before anything is built: one line each."""
    section = config.agent
    if section is None:
        return
    if config.tools is not None:
        raise ConfigError(
            "agent: an agent runs its own tools (it sends their specs with its requests); remove the tools: section, "
            "or the agent: section to train the built-in tool loop"
        )
    limit = config.train.data_timeout_s
    if limit is not None and section.request_timeout_s >= limit:
        raise ConfigError(
            f"agent.request_timeout_s: {section.request_timeout_s:g} s is not below train.data_timeout_s={limit:g}; "
            "a silent agent must time out before the environment step does (lower it or raise train.data_timeout_s)"
        )


def wrap_with_agent(envs: list[Any], config: Config) -> list[Any]:
    """Each of ``envs`` played by the ``agent:`` section's agent (:class:`palestra.agents.bridge.AgentEnvironment`),
    through one rollout endpoint; it starts at the first rollout and stops when training ends."""
    from palestra.agents.bridge import AgentEnvironment
    from palestra.agents.server import AgentServer
    from palestra.registry import Requirement

    section = config.agent
    assert section is not None
    for module in ("fastapi", "uvicorn", "openai"):  # the endpoint and the client the agents are handed
        needed = Requirement(module, 'pip install "palestra[agents]"')
        if not needed.installed():
            raise needed.missing("the agent: section (its rollout endpoint)")
    agent = build_component("agent", section, path="agent")
    if not callable(getattr(agent, "rollout", None)):
        raise ComponentBuildError(
            f"agent: agent {section.name!r} built a {type(agent).__name__}, which has no rollout(client, task) method"
        )
    parser = build_component("tool_parser", section.tool_parser, path="agent.tool_parser")
    server = AgentServer()
    return [
        AgentEnvironment(
            env,
            agent,
            server,
            parser,
            max_turns=section.max_turns,
            request_timeout_s=section.request_timeout_s,
            max_concurrency=section.max_concurrency,
            name=config.environment.name,
            agent_name=section.name,
        )
        for env in envs
    ]
