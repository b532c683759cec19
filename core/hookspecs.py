"""Palestra's hook specifications: the one place a plugin looks to see what it can provide.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names match these specs.
Registration hooks receive a ``register`` callback rather than returning lists, so a plugin can register
any number of components and every registration is attributed to the plugin that made it::

    from palestra import hookimpl

    @hookimpl
    def register_rewards(register):
        register("keyword", KeywordReward, options=KeywordReward.Options, description="1 if the keyword appears")

Lifecycle hooks are called by the trainer with a read-only :class:`~palestra.run_state.RunState` (``run``: the
step, the latest metrics, the config, the run folder, the rank), never the trainer itself. Every implementation
runs; pluggy calls them last-registered first, and a plugin should not rely on any order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from palestra.run_state import RunState
    from palestra.types import Experience

PROJECT = "palestra"
# The version of this contract (the hooks below, the types, the context). A hook renamed or removed, or a type or
# hook argument changed incompatibly, bumps the major part (a hook or a field added, the minor part); docs/plugins.md
# says what changed for plugin authors.
PLUGIN_API = "2.2"
# A plugin module may declare the plugin API versions it works with, as a version specifier string
# (PEP 440), e.g. ``PALESTRA_PLUGIN_API = ">=2.0,<3"``; one that excludes PLUGIN_API is disabled with one warning.
PLUGIN_API_ATTRIBUTE = "PALESTRA_PLUGIN_API"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RegisterFn(Protocol):
    """The callback handed to every ``register_*`` hook.

    ``name`` is how configs refer to the component; ``factory`` builds it and is called with the
    validated options as keyword arguments; ``options`` is a dataclass type declaring those options
    (their types and defaults), or ``None`` when the component takes none. Registering a name that
    another plugin already registered for the same kind is an error naming both plugins.
    """

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        options: type | None = None,
        description: str = "",
    ) -> None: ...


# ---- registration ----------------------------------------------------------------------------------
@hookspec
def register_environments(register: RegisterFn) -> None:
    """Register environments: sources of prompts or dialogues (single- or multi-agent, single- or multi-turn)."""


@hookspec
def register_rewards(register: RegisterFn) -> None:
    """Register rewards: score a batch of (prompt, completion, metadata) into a float tensor."""


@hookspec
def register_optimizers(register: RegisterFn) -> None:
    """Register policy optimisers (the RL algorithms): each owns its loss and its update."""


@hookspec
def register_policies(register: RegisterFn) -> None:
    """Register policies: model back ends that generate completions and score token log-probs."""


@hookspec
def register_loggers(register: RegisterFn) -> None:
    """Register metric loggers (console, JSONL, TensorBoard, wandb, ...)."""


@hookspec
def register_generators(register: RegisterFn) -> None:
    """Register generation back ends for rollouts (the built-in KV-cache sampler; vLLM and others later)."""


@hookspec
def register_tools(register: RegisterFn) -> None:
    """Register tools a model may call in an episode (:class:`palestra.tools.Tool`; docs/tools.md). The factory
    returns one ``Tool`` or a list of them (an MCP server's tools); :meth:`Tool.from_function` derives the JSON Schema
    of a plain function's parameters from its type hints and docstring."""


@hookspec
def register_tool_parsers(register: RegisterFn) -> None:
    """Register tool-call parsers (:class:`palestra.tools.ToolCallParser`): how a model's text is read as tool calls
    (``hermes``: ``<tool_call>{json}</tool_call>``), and how tools are described to a model whose chat template has no
    tool section."""


@hookspec
def register_agents(register: RegisterFn) -> None:
    """Register agents (:class:`palestra.agents.Agent`): code with ``async def rollout(client, task)`` that plays an
    environment's task through an OpenAI-compatible client pointed at the policy under training (the ``agent:``
    section; docs/environments.md). It returns an :class:`palestra.agents.AgentResult` or the answer as a str."""


# ---- lifecycle --------------------------------------------------------------------------------------
@hookspec
def on_train_start(run: RunState) -> None:
    """Called once, after every component is built and before the held-out evaluation and the first rollout."""


@hookspec
def on_train_end(run: RunState) -> None:
    """Called once when training ends normally; ``run.metrics`` are the last step's."""


@hookspec
def on_step_start(run: RunState) -> None:
    """Before step ``run.step`` (0-based) begins its rollout, on every rank."""


@hookspec
def on_rollout_end(run: RunState, batch: Experience) -> None:
    """After the step's rollouts are generated and scored (refills included), before the update; ``run.metrics`` are
    the reward's. Must not modify ``batch``."""


@hookspec
def on_update_end(run: RunState, batch: Experience) -> None:
    """After the algorithm's update, with the batch it trained on: prepared (advantages, reference log-probs).
    ``run.metrics`` are the step's so far, this rank's own (``train/skipped`` is 1 when no step was taken). Must not
    modify ``batch``."""


@hookspec
def on_optimizer_step(run: RunState) -> None:
    """After each optimiser step; ``run.step`` counts it (from 1) and ``run.metrics`` are the step's, averaged over
    the ranks (entropy, KL, grad norm, ...)."""


@hookspec
def on_checkpoint_save(run: RunState, state: dict[str, Any]) -> None:
    """Called before a checkpoint is written; a plugin may add its own entries (plain data) to ``state``."""


@hookspec
def on_checkpoint_load(run: RunState, state: Mapping[str, Any]) -> None:
    """Called after a checkpoint is read, so a plugin can restore the entries it saved."""
