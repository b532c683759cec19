"""Several agents, one model family: :class:`MultiAgentPolicy`, parameter sharing by layer group.

``agents.shared_layers`` / ``agents.independent_layers`` (see :class:`palestra.config.AgentsConfig`) name the
policy's layer groups (:meth:`palestra.models.policy.CausalLMPolicy.layer_groups`: ``embedding``, ``encoder``,
``decoder``). Each agent gets a *view*: a full policy of the base's class whose shared groups are the very
same modules (one set of tensors, trained by every agent's rows) and whose independent groups are its own
deep copy (initialised identical). All shared is one policy with several names; all independent is separate
policies. A weight tied across two groups in different sharing classes (the tiny policy's embedding and
output head) is untied first: one copy per group, equal at the start.

Why views rather than one module that routes inside its forward: a view is an ordinary
:class:`~palestra.models.policy.CausalLMPolicy`, so KV caches and ``score`` work on it unchanged. The policy itself
is what the rollout and the learner call, with the rows' agent ids as data: :meth:`MultiAgentPolicy.score` scores
each agent's rows with its view, and :meth:`MultiAgentPolicy.decode_step` decodes one agent's rows with its view
(the rollout samples each agent's rows apart). Calls go through the policy, never straight to a view, so that
under FSDP2 the policy's own forward hooks run first (it is the root).

``update_frequency`` (the contract between this module and the ``mappo`` optimiser): the independent layers take
an optimiser step on every update; the shared layers' gradients, from every agent, accumulate over
``update_frequency`` updates and then take one step with their mean. ``update_frequency: 1`` is ordinary sharing.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from palestra.errors import ConfigError
from palestra.models.policy import CausalLMPolicy, TokenScores
from palestra.types import AgentId, GradientCheckpointing, Observation

if TYPE_CHECKING:
    from palestra.config import AgentsConfig

__all__ = ["MultiAgentPolicy", "check_sharing", "wrap_policy"]

_KEY_PATH = "agents"


def check_sharing(agents: AgentsConfig, groups: Mapping[str, Sequence[str]], *, path: str = _KEY_PATH) -> None:
    """Raise a one-line :class:`ConfigError` unless every layer group is in exactly one of the two lists."""
    valid = list(groups)
    for key in ("shared_layers", "independent_layers"):
        for i, name in enumerate(getattr(agents, key)):
            if name not in groups:
                raise ConfigError(
                    f"{path}.{key}[{i}]: unknown layer group {name!r}; the policy's layer groups are {', '.join(valid)}"
                )
    both = [g for g in valid if g in agents.shared_layers and g in agents.independent_layers]
    if both:
        raise ConfigError(f"{path}: layer group(s) {', '.join(both)} are in both shared_layers and independent_layers")
    neither = [g for g in valid if g not in agents.shared_layers and g not in agents.independent_layers]
    if neither:
        raise ConfigError(
            f"{path}: layer group(s) {', '.join(neither)} are in neither shared_layers nor independent_layers; "
            "put every group in exactly one"
        )


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _group_of(name: str, groups: Mapping[str, Sequence[str]]) -> str | None:
    for group, prefixes in groups.items():
        if any(_under(name, p) for p in prefixes):
            return group
    return None


def _untie(base: torch.nn.Module, groups: Mapping[str, Sequence[str]], shared: set[str]) -> list[str]:
    """Give each sharing class its own copy of a weight tied across classes; return the untied names."""
    first: dict[int, tuple[str, str]] = {}  # id(param) -> (its first name, its group)
    untied: list[str] = []
    for name, param in list(base.named_parameters(remove_duplicate=False)):
        group = _group_of(name, groups)
        if group is None:
            continue
        seen = first.setdefault(id(param), (name, group))
        if seen[1] != group and ((seen[1] in shared) != (group in shared)):
            owner_name, _, attr = name.rpartition(".")
            owner = base.get_submodule(owner_name)
            setattr(owner, attr, torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
            untied.append(name)
    if untied and isinstance(base, CausalLMPolicy):
        base.keep_untied()  # so that a later re-tie (HF's tie_weights()) does not tie them back
    return untied


class MultiAgentPolicy(torch.nn.Module):
    """One view per agent over a base policy, sharing the configured layer groups (see the module docstring).

    ``views[key]`` is agent ``agent_ids[i]``'s policy (the first agent's view is the base itself). The module's
    ``parameters()`` list every tensor once; :meth:`shared_parameters` and :meth:`agent_parameters` split them.
    """

    def __init__(self, base: Any, agents: AgentsConfig, agent_ids: Sequence[AgentId], *, path: str = _KEY_PATH) -> None:
        super().__init__()
        ids = list(dict.fromkeys(agent_ids))
        if not ids:
            raise ConfigError(f"{path}: the environment declares no agent_ids; multi-agent training needs at least one")
        groups = base.layer_groups()
        check_sharing(agents, groups, path=path)
        uncovered = [n for n, _ in base.named_parameters() if _group_of(n, groups) is None]
        if uncovered:
            raise ConfigError(
                f"{path}: parameters {', '.join(uncovered[:4])} of {type(base).__name__} are in no layer group"
            )
        self.config = agents
        self.groups = {g: list(p) for g, p in groups.items()}
        self.shared_groups = [g for g in groups if g in agents.shared_layers]
        self.untied = _untie(base, groups, set(self.shared_groups))
        shared_modules = [base.get_submodule(p) for g in self.shared_groups for p in groups[g]]
        self.agent_ids: tuple[AgentId, ...] = tuple(ids)
        self._keys = {a: (a if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", a) else f"agent_{i}") for i, a in enumerate(ids)}
        self.views = torch.nn.ModuleDict()
        for i, a in enumerate(ids):
            # deepcopy with the shared modules pre-seeded in the memo: they stay the same objects, the rest is copied
            memo = {id(m): m for m in shared_modules}
            self.views[self._keys[a]] = base if i == 0 else copy.deepcopy(base, memo)
        self.tokenizer = base.tokenizer

    # ---- routing -------------------------------------------------------------------------------------------
    def for_agent(self, agent_id: AgentId) -> Any:
        """Agent ``agent_id``'s view: an ordinary CausalLMPolicy (generators and score work on it unchanged)."""
        key = self._keys.get(agent_id)
        if key is None:
            raise KeyError(f"MultiAgentPolicy: unknown agent {agent_id!r}; the agents are {', '.join(self.agent_ids)}")
        return self.views[key]

    @property
    def base(self) -> Any:
        return self.views[self._keys[self.agent_ids[0]]]

    def layer_groups(self) -> dict[str, list[str]]:
        return {g: list(p) for g, p in self.groups.items()}

    def _is_shared(self, name: str) -> bool:
        return _group_of(name, self.groups) in self.shared_groups

    def shared_parameters(self) -> list[torch.nn.Parameter]:
        """The shared groups' parameters (one tensor each, used by every agent)."""
        return [p for n, p in self.base.named_parameters() if self._is_shared(n)]

    def agent_parameters(self, agent_id: AgentId) -> list[torch.nn.Parameter]:
        """Agent ``agent_id``'s own (independent groups') parameters."""
        return [p for n, p in self.for_agent(agent_id).named_parameters() if not self._is_shared(n)]

    def parameter_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        """``{"shared": [...], agent_id: [...], ...}``: every trainable parameter exactly once (empty lists dropped)."""
        out = {"shared": [p for p in self.shared_parameters() if p.requires_grad]}
        for a in self.agent_ids:
            out[a] = [p for p in self.agent_parameters(a) if p.requires_grad]
        return {k: v for k, v in out.items() if v}

    # ---- the Policy protocol -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def max_len(self) -> Any:
        return getattr(self.base, "max_len", None)

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    def model_dims(self) -> dict[str, int]:
        return self.base.model_dims()

    def encode_observations(self, observations: Sequence[Observation]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.encode_observations(observations)

    def encode_prompt(self, observation: Observation) -> list[int]:
        return self.base.encode_prompt(observation)

    def prompt_text(self, observation: Observation) -> str:
        return self.base.prompt_text(observation)

    def token_text(self, token_id: int) -> str:
        return self.base.token_text(token_id)

    def prefix_preserving(self) -> bool:
        return bool(self.base.prefix_preserving())

    def enable_value_head(self) -> Any:
        """A value head per agent view (heads are never shared: each agent's returns are its own)."""
        # the views are policies of the base's class (built in __init__); ModuleDict types them as Module
        return [cast(CausalLMPolicy, self.views[k]).enable_value_head() for k in self.views]

    def set_gradient_checkpointing(self, on: bool) -> None:
        for view in self.views.values():
            if isinstance(view, GradientCheckpointing):
                view.set_gradient_checkpointing(on)

    def _single_view(self, what: str) -> Any:
        if len(self.agent_ids) == 1 or not self.config.independent_layers:
            return self.base  # every view computes the same function
        raise ValueError(
            f"MultiAgentPolicy.{what}: agents have independent layers ({', '.join(self.config.independent_layers)}); "
            "pass agent_ids (one per row) or use for_agent(agent_id)"
        )

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        entropy: bool = True,
        values: bool = False,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> TokenScores:
        """Each row scored by its agent's view (``agent_ids[b]``); the rows come back in their order."""
        kw = {"temperature": temperature, "entropy": entropy, "values": values}
        if agent_ids is None:
            return self._single_view("score").score(prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)
        if len(agent_ids) != prompt_ids.shape[0]:
            raise ValueError(
                f"MultiAgentPolicy.score: agent_ids has {len(agent_ids)} entries for {prompt_ids.shape[0]} rows"
            )
        order = list(dict.fromkeys(agent_ids))
        if len(order) == 1:
            return self.for_agent(order[0]).score(prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)
        rows = [[i for i, a in enumerate(agent_ids) if a == agent] for agent in order]
        parts = []
        for agent, idx in zip(order, rows):
            t = torch.as_tensor(idx, device=prompt_ids.device)
            parts.append(
                self.for_agent(agent).score(prompt_ids[t], prompt_mask[t], completion_ids[t], completion_mask[t], **kw)
            )
        inverse = torch.empty(len(agent_ids), dtype=torch.int64, device=prompt_ids.device)
        inverse[torch.as_tensor([i for idx in rows for i in idx], device=prompt_ids.device)] = torch.arange(
            len(agent_ids), device=prompt_ids.device
        )

        def joined(name: str) -> torch.Tensor | None:
            got = [getattr(p, name) for p in parts]
            return None if got[0] is None else torch.cat(got)[inverse]

        return TokenScores(logprobs=joined("logprobs"), entropy=joined("entropy"), values=joined("values"))  # type: ignore[arg-type]

    def token_logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, agent_ids=None):
        return self.score(
            prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=False, agent_ids=agent_ids
        ).logprobs

    @torch.no_grad()
    def decode_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        *,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """One decode step of the agent every row names (``agent_ids``), with that agent's view and KV cache.

        The rows of one call must name one agent: a cache belongs to one view (the rollout generates each agent's
        rows apart, :func:`palestra.multiagent.generation.generate_by_agent`)."""
        if agent_ids is None:
            view = self._single_view("decode_step")
        else:
            agents = list(dict.fromkeys(agent_ids))
            if len(agents) != 1:
                raise ValueError(
                    f"MultiAgentPolicy.decode_step: the rows name agents {', '.join(map(repr, agents)) or 'none'}; "
                    "one call decodes one agent's rows (its view's KV cache)"
                )
            view = self.for_agent(agents[0])
        return view.decode_step(input_ids, attention_mask, position_ids, cache)

    def named_views(self) -> Iterator[tuple[AgentId, Any]]:
        for a in self.agent_ids:
            yield a, self.for_agent(a)

    def extra_repr(self) -> str:
        shared = ", ".join(self.shared_groups) or "none"
        return f"agents={list(self.agent_ids)}, shared={shared}, update_frequency={self.config.update_frequency}"


def wrap_policy(policy: Any, agents: AgentsConfig | None, env: Any, algorithm: Any = None) -> Any:
    """The trainer's one call: ``policy`` wrapped in a :class:`MultiAgentPolicy` when ``agents`` is configured.

    An optimiser that scores rows without agent ids cannot train independent layers; that is a config error
    here (before any step) rather than a failure in the first update.
    """
    if agents is None:
        return policy
    if agents.independent_layers and algorithm is not None and not algorithm.routes_agents:
        raise ConfigError(
            f"{_KEY_PATH}.independent_layers: optimizer {algorithm.name!r} "
            "scores rows without agent ids, so it cannot train per-agent layers; use optimizer.name: mappo "
            "or put every layer group in agents.shared_layers"
        )
    if agents.update_frequency > 1 and algorithm is not None and not algorithm.shared_update_window:
        raise ConfigError(
            f"{_KEY_PATH}.update_frequency: optimizer {algorithm.name!r} steps "
            f"every parameter every update, so update_frequency={agents.update_frequency} would be ignored; "
            "use optimizer.name: mappo or update_frequency: 1"
        )
    agent_ids = tuple(env.agent_ids or ())
    return MultiAgentPolicy(policy, agents, agent_ids)
