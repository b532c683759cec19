"""The interfaces Palestra's parts meet at: environments, rewards, policies, policy optimisers, loggers.

Shapes follow one convention: ``B`` rows in a batch (prompts x group), ``P`` prompt tokens, ``T`` completion tokens.

Environments are *batched* and *turn-based*. A batch holds ``B`` independent episodes (like PettingZoo's
parallel API, one row per episode); inside an episode exactly one agent acts per turn (like PettingZoo's
AEC API), and the environment says which agent that is in every :class:`Observation`. A single-agent,
single-turn task (a prompt, one completion, done) is the special case with one agent id and one turn;
a turn-based multi-agent pipeline (query understanding -> knowledge retrieval -> response generation)
changes ``agent_id`` from turn to turn. Simultaneous moves are modelled as consecutive turns whose
observations do not show each other's actions.

Environments deal in text. Tokenisation belongs to the policy, but an environment may hand over chat
``messages`` (for a chat template) or ready ``token_ids`` when it knows better.

Rewards are separate components that score ``(prompt, completion, metadata)`` rows; ``metadata`` is the
environment's per-episode dictionary (for example the ground-truth answer), so a reward never needs to
know which environment produced a row. Every reward a config builds is called through
:class:`palestra.checked_reward.CheckedReward`, which rejects bad outputs with a one-line error naming the reward.

Only :class:`Experience` and the episode records carry behaviour here; the rest are
:class:`typing.Protocol` classes that plugins implement (structurally: no base class to inherit).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported where tensors are made, so loading plugins (and `palestra config`) stays fast
    import torch

    from palestra.context import TrainContext

AgentId = str
"""Who acts: a role name such as ``"assistant"``, ``"retriever"`` or ``"responder"``."""

DEFAULT_AGENT: AgentId = "assistant"


# ---- environments ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One chat message, as chat templates expect it (see :meth:`as_dict`)."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Observation:
    """What the agent that acts next in one episode sees.

    ``prompt`` is always there: the full text to continue. ``messages`` is the same context as chat
    messages, for policies that apply a chat template (prefer it when present). ``token_ids``, when the
    environment sets it, is the exact prompt to feed the policy (skipping its tokenizer).
    ``metadata`` is the episode's dictionary handed to rewards (ground truth, the task's parameters);
    treat it as read-only. ``stop`` lists extra stop strings for this turn.

    ``tools`` and ``tool_prompt`` (both or neither) offer tools to the agent (see the fields).

    ``max_new_tokens`` is the environment's cap on this turn's completion (e.g. one token for a label);
    None leaves the trainer's limit. The effective limit is ``min(train.max_new_tokens, obs.max_new_tokens)``;
    a row that reaches it ends like any length-truncated completion (its tokens so far kept, no EOS).
    """

    prompt: str
    agent_id: AgentId = DEFAULT_AGENT
    messages: list[Message] | None = None
    token_ids: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    stop: list[str] | None = None
    turn: int = 0  # 0-based index of this turn within its episode
    max_new_tokens: int | None = None  # this turn's cap (min with train.max_new_tokens); None: no extra cap
    # The tools the agent may call this turn, as OpenAI-style function specs ({"type": "function", "function":
    # {name, description, parameters}}), for a chat template's tool section; and the same tools described in plain
    # text (the tool-call parser's format), which a policy whose template has no tool section puts in a system
    # message instead (docs/tools.md). None: no tools.
    tools: list[dict[str, Any]] | None = None
    tool_prompt: str | None = None


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns, one entry per batch row.

    ``observations[i]`` is the next observation of episode ``i`` (``None`` once it is done);
    ``done[i]`` says the episode ended with this step; ``info[i]`` maps agent id -> diagnostics for that
    agent (what the environment parsed from its action, whether a tool call succeeded, ...), kept in the
    :class:`Turn` record and never used as a reward by itself.
    """

    observations: list[Observation | None]
    done: list[bool]
    info: list[dict[AgentId, dict[str, Any]]]

    def __post_init__(self) -> None:
        n = len(self.observations)
        if len(self.done) != n or len(self.info) != n:
            raise ValueError(
                f"StepResult: observations, done and info must have one entry per row; got lengths "
                f"{n}, {len(self.done)} and {len(self.info)}"
            )
        for i, (obs, d) in enumerate(zip(self.observations, self.done)):
            if (obs is None) != bool(d):
                raise ValueError(f"StepResult: row {i} has done={d} but observation {'None' if obs is None else 'set'}")


@runtime_checkable
class Environment(Protocol):
    """A batched, turn-based source of prompts for one or more agents (see the module docstring).

    Lifecycle: ``obs = env.reset(batch_size, seed=..., group_size=G)``; then while some row is not done,
    ``res = env.step(actions)`` where ``actions[i]`` is the text the agent named in row ``i``'s latest
    observation produced (``None`` for rows already done), and ``res.observations`` are the next ones.
    ``reset`` starts a new batch and forgets the old one. :func:`palestra.engine.rollout.run_episodes` is the
    reference driver.
    """

    agent_ids: tuple[AgentId, ...]
    """Every agent that may act, in the order they first act (PettingZoo's ``possible_agents``)."""

    max_turns: int
    """An upper bound on turns per episode (1 for single-turn tasks); the driver stops there."""

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        """Start ``batch_size * group_size`` episodes and return their first observations.

        Rows ``[g * group_size, (g + 1) * group_size)`` share one task (same prompt and metadata), so a
        group-relative optimiser can compare completions of the same task. The same ``seed`` gives the
        same tasks; ``seed=None`` draws fresh ones from the environment's own generator.
        """
        ...

    def step(self, actions: Sequence[str | None]) -> StepResult:
        """Apply one action per row (``None`` for rows already done) and advance every live episode one turn."""
        ...


# ---- episode records ---------------------------------------------------------------------------------
@dataclass
class Turn:
    """One turn of an episode: who acted, what they saw, what they produced, and what the environment made of it."""

    agent_id: AgentId
    observation: Observation
    completion: str
    info: dict[str, Any] = field(default_factory=dict)  # the acting agent's entry of StepResult.info


@dataclass
class Episode:
    """A finished (or truncated) episode: its turns in order and its metadata (for rewards)."""

    turns: list[Turn] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False  # stopped at max_turns before the environment said done

    def by_agent(self, agent_id: AgentId) -> list[Turn]:
        return [t for t in self.turns if t.agent_id == agent_id]

    @property
    def agents(self) -> list[AgentId]:
        """Agents in the order they first acted."""
        return list(dict.fromkeys(t.agent_id for t in self.turns))

    @property
    def last(self) -> Turn:
        if not self.turns:
            raise ValueError("the episode has no turns")
        return self.turns[-1]

    def transcript(self) -> str:
        """A readable log: one ``[turn] agent: completion`` paragraph per turn."""
        return "\n".join(f"[{i}] {t.agent_id}: {t.completion}" for i, t in enumerate(self.turns))


# ---- rewards -----------------------------------------------------------------------------------------
@dataclass
class RewardOutput:
    """A reward's result for a batch of ``B`` rows.

    ``scores`` is the float tensor ``[B]`` the optimiser sees. ``components`` holds named ``[B]`` parts
    for logging (a weighted sum reports every term); ``metrics`` holds scalars to log (which curriculum
    layers are active, moving averages).
    """

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Reward(Protocol):
    """Scores rows of ``(prompt, completion, metadata)``.

    Return a float tensor ``[B]`` (a list of numbers or a 1-D array is accepted) or a
    :class:`RewardOutput`. Everything must be finite. A reward with state that must survive a checkpoint
    (moving averages, a curriculum's progress) also implements ``state_dict()`` / ``load_state_dict()``.
    """

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor | Sequence[float] | RewardOutput: ...


# ---- experience, policies, optimisers, loggers ------------------------------------------------------
@dataclass
class Experience:
    """A batch of scored completions, ready for a policy update.

    Token tensors are ``[B, T]`` (completion) and ``[B, P]`` (prompt, left-padded). ``completion_mask`` is
    True on tokens the policy generated and that count in the loss (False on padding and on text an
    environment inserted). ``advantages`` is ``[B]`` (one per completion, as in GRPO) or ``[B, T]``.
    ``group_ids[b]`` names the task row ``b`` belongs to (rows of one group share a prompt).
    """

    prompt_ids: torch.Tensor  # [B, P] int64
    prompt_mask: torch.Tensor  # [B, P] bool
    completion_ids: torch.Tensor  # [B, T] int64
    completion_mask: torch.Tensor  # [B, T] bool
    behaviour_logprobs: torch.Tensor  # [B, T] float32: log-probs under the policy that sampled the tokens
    rewards: torch.Tensor  # [B] float32
    advantages: torch.Tensor  # [B] or [B, T] float32
    group_ids: torch.Tensor  # [B] int64
    agent_ids: list[AgentId]  # [B]
    ref_logprobs: torch.Tensor | None = None  # [B, T] under the frozen reference policy, for a KL term
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B], for logging
    metadata: list[dict[str, Any]] = field(default_factory=list)  # [B] (may be empty)
    returns: torch.Tensor | None = None  # [B, T] value targets (PPO), set by the optimiser's prepare()
    old_values: torch.Tensor | None = None  # [B, T] values at rollout time (PPO value clipping)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, ...]: an optimiser's own per-row data
    # [B, T] the learner's own log-probs before the update (the proximal policy of rollout correction); set by the
    # learner when an update needs them across passes, None otherwise
    old_logprobs: torch.Tensor | None = None

    _ROW_FIELDS = (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "behaviour_logprobs",
        "rewards",
        "advantages",
        "group_ids",
        "ref_logprobs",
        "returns",
        "old_values",
        "old_logprobs",
    )

    def select(self, index: torch.Tensor | Sequence[int]) -> Experience:
        """The rows ``index`` (a 1-D index tensor or list), every per-row field sliced alike."""
        import torch

        idx = index if isinstance(index, torch.Tensor) else torch.as_tensor(list(index), dtype=torch.int64)
        idx = idx.to(self.completion_ids.device)
        rows = idx.tolist()
        # each field keeps its own type (a tensor, or None for an optional one)
        picked: dict[str, Any] = {
            k: (None if getattr(self, k) is None else getattr(self, k)[idx]) for k in self._ROW_FIELDS
        }
        return Experience(
            **picked,
            agent_ids=[self.agent_ids[i] for i in rows],
            reward_components={k: v[idx] for k, v in self.reward_components.items()},
            metadata=[self.metadata[i] for i in rows] if self.metadata else [],
            extras={k: v[idx] for k, v in self.extras.items()},
        )

    @staticmethod
    def concat(batches: Sequence[Experience], pad_token_id: int = 0) -> Experience:
        """One batch from several, re-padding prompts (on the left) and completions (on the right) to a common width."""
        import torch

        if not batches:
            raise ValueError("Experience.concat: no batches")
        p = max(b.prompt_ids.shape[1] for b in batches)
        t = max(b.completion_ids.shape[1] for b in batches)

        def left(x: torch.Tensor, width: int, fill: Any) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=fill)

        def right(x: torch.Tensor | None, width: int, fill: Any) -> torch.Tensor | None:
            return None if x is None else torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)

        def cat(name: str, pad: Any) -> torch.Tensor | None:
            parts = [getattr(b, name) for b in batches]
            if all(x is None for x in parts):
                return None
            if any(x is None for x in parts):
                raise ValueError(f"Experience.concat: {name} is set in some batches and not in others")
            return torch.cat([pad(x) for x in parts])

        def per_token(x: torch.Tensor) -> torch.Tensor:
            return right(x, t, 0) if x.dim() == 2 else x  # type: ignore[return-value]

        keys = set(batches[0].reward_components)
        extras = set(batches[0].extras)
        return Experience(
            prompt_ids=cat("prompt_ids", lambda x: left(x, p, pad_token_id)),  # type: ignore[arg-type]
            prompt_mask=cat("prompt_mask", lambda x: left(x, p, False)),  # type: ignore[arg-type]
            completion_ids=cat("completion_ids", lambda x: right(x, t, pad_token_id)),  # type: ignore[arg-type]
            completion_mask=cat("completion_mask", lambda x: right(x, t, False)),  # type: ignore[arg-type]
            behaviour_logprobs=cat("behaviour_logprobs", per_token),  # type: ignore[arg-type]
            rewards=cat("rewards", lambda x: x),  # type: ignore[arg-type]
            advantages=cat("advantages", per_token),  # type: ignore[arg-type]
            group_ids=cat("group_ids", lambda x: x),  # type: ignore[arg-type]
            agent_ids=[a for b in batches for a in b.agent_ids],
            ref_logprobs=cat("ref_logprobs", per_token),
            returns=cat("returns", per_token),
            old_values=cat("old_values", per_token),
            old_logprobs=cat("old_logprobs", per_token),
            reward_components={
                k: torch.cat([b.reward_components[k] for b in batches])
                for k in keys
                if all(k in b.reward_components for b in batches)
            },
            metadata=[m for b in batches for m in b.metadata] if all(b.metadata for b in batches) else [],
            extras={
                k: torch.cat([b.extras[k] for b in batches]) for k in extras if all(k in b.extras for b in batches)
            },
        )

    @property
    def batch_size(self) -> int:
        return int(self.completion_ids.shape[0])

    def validate(self) -> Experience:
        """Check shapes and dtypes agree; raise a one-line ValueError naming the field. Returns self."""
        import torch

        if self.completion_ids.dim() != 2:
            raise ValueError(f"Experience.completion_ids: expected shape [B, T], got {list(self.completion_ids.shape)}")
        b, t = self.completion_ids.shape
        p = self.prompt_ids.shape[-1] if self.prompt_ids.dim() == 2 else -1
        expected: dict[str, tuple[torch.Tensor | None, tuple[tuple[int, ...], ...]]] = {
            "prompt_ids": (self.prompt_ids, ((b, p),)),
            "prompt_mask": (self.prompt_mask, ((b, p),)),
            "completion_mask": (self.completion_mask, ((b, t),)),
            "behaviour_logprobs": (self.behaviour_logprobs, ((b, t),)),
            "rewards": (self.rewards, ((b,),)),
            "advantages": (self.advantages, ((b,), (b, t))),
            "group_ids": (self.group_ids, ((b,),)),
            "ref_logprobs": (self.ref_logprobs, ((b, t),)),
            "returns": (self.returns, ((b, t),)),
            "old_values": (self.old_values, ((b, t),)),
            "old_logprobs": (self.old_logprobs, ((b, t),)),
            **{f"reward_components[{k!r}]": (v, ((b,),)) for k, v in self.reward_components.items()},
        }
        for name, (tensor, shapes) in expected.items():
            if tensor is None:
                continue
            if tuple(tensor.shape) not in shapes:
                want = " or ".join(str(list(s)) for s in shapes)
                raise ValueError(f"Experience.{name}: expected shape {want} (B={b}, T={t}), got {list(tensor.shape)}")
        for name in ("prompt_mask", "completion_mask"):
            if getattr(self, name).dtype != torch.bool:
                raise ValueError(f"Experience.{name}: expected dtype torch.bool, got {getattr(self, name).dtype}")
        for name in ("prompt_ids", "completion_ids", "group_ids"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"Experience.{name}: expected dtype torch.int64, got {getattr(self, name).dtype}")
        for name in ("behaviour_logprobs", "rewards", "advantages", "ref_logprobs", "old_logprobs"):
            tensor = getattr(self, name)
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"Experience.{name}: expected a floating dtype, got {tensor.dtype}")
        if len(self.agent_ids) != b:
            raise ValueError(f"Experience.agent_ids: expected {b} entries, got {len(self.agent_ids)}")
        if self.metadata and len(self.metadata) != b:
            raise ValueError(f"Experience.metadata: expected {b} entries (or none), got {len(self.metadata)}")
        return self


@dataclass
class Generation:
    """What :meth:`Policy.generate` returns for ``B`` observations."""

    texts: list[str]  # [B] decoded completions (without the prompt)
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool
    completion_ids: torch.Tensor  # [B, T] int64, right-padded
    completion_mask: torch.Tensor  # [B, T] bool
    logprobs: torch.Tensor  # [B, T] float32: log-probs of the sampled tokens under the sampling distribution


@dataclass
class SamplingParams:
    """How to sample completions. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings for every row (observations may add their own)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS


class Policy(Protocol):
    """A language model that acts: it encodes observations and scores tokens (see
    :class:`palestra.models.policy.CausalLMPolicy`).

    Implementations own their tokenizer, device and dtype. ``score`` must be differentiable with respect
    to ``parameters()``: it is what an optimiser's loss is built from. Sampling is a generator's job
    (:class:`Generator`), which drives ``decode_step``.
    """

    tokenizer: Any

    def encode_observations(self, observations: Sequence[Observation]) -> tuple[torch.Tensor, torch.Tensor]: ...

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
    ) -> Any:
        """A :class:`palestra.models.policy.TokenScores`: log-probs, entropy and values ``[B, T]`` (0 where masked).

        ``agent_ids`` (one per row, or None) says which agent acted in each row: a multi-agent policy scores each
        row with that agent's parameters; a single-agent policy accepts it and ignores it."""
        ...

    def for_agent(self, agent_id: AgentId) -> Policy:
        """The policy that plays ``agent_id``: itself for a single-agent policy, an agent's own view for a multi-agent
        one. The rollout samples rows played by the same policy in one batch (through this policy, with agent ids)."""
        ...

    def decode_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        *,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Logits for the next token and the extended KV cache; ``agent_ids`` as in :meth:`score` (a multi-agent
        policy decodes one agent's rows per call)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


class Generator(Protocol):
    """A generation back end (the built-in KV-cache sampler; vLLM and others can plug in here)."""

    def generate(
        self,
        policy: Policy,
        observations: Sequence[Observation],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Sample one completion per observation. ``generator`` seeds the sampling (same seed, same completions)."""
        ...


class PolicyOptimizer(Protocol):
    """An RL algorithm (GRPO, PPO, RLOO, MAPPO, ...) as the learner and the trainer use it: exactly the calls below.

    The config section and the registry kind are ``optimizer``; in code it is an *algorithm*. It owns the RL content
    only: the :class:`~palestra.engine.learner.Learner` does the forward, micro-batches, precision, clipping, the
    optimiser steps and checkpoints, and calls ``bind`` once, then per step ``advantages`` (inside its
    ``prepare``) and ``loss`` (on each micro-batch, with the policy's scores). An algorithm never calls the policy.
    Most algorithms subclass :class:`palestra.Algorithm` and supply only ``advantages`` and ``loss``.
    """

    name: str  # the registered name; prefixes error messages
    needs_reference: bool  # True when the learner must score a frozen copy of the policy (a KL term)
    needs_value_head: bool  # True when the policy needs a value head (the learner scores its values)
    routes_agents: bool  # scores each row with its agent's parameters (needed for agents.independent_layers)
    shared_update_window: bool  # honours agents.update_frequency (steps the shared layers every N updates)
    refill_rounds: int  # extra rollouts a step may draw while groups_short() > 0 (DAPO's refill); 0 for most

    def bind(self, policy: Policy, context: TrainContext) -> None:
        """Called once by the learner, before it builds the optimisers: the run's context (and checks against it)."""
        ...

    def advantages(self, batch: Experience) -> Experience:
        """Fill in ``advantages`` (and ``returns`` as needed) for a fresh rollout; no gradients. ``ref_logprobs`` and
        (with a value head) ``old_values`` are already there."""
        ...

    def loss(self, batch: Experience, scores: Any) -> tuple[torch.Tensor, Mapping[str, Any]]:
        """The differentiable loss of one micro-batch from the policy's ``scores`` (log-probs, entropy, values) and
        its token-mean metrics. ``batch.old_logprobs`` are what the policy ratio is taken against."""
        ...

    def groups_short(self, batch: Experience) -> int:
        """How many more groups with a training signal ``batch`` needs before the update (asked while refill rounds
        remain; 0: the batch is ready)."""
        ...

    def extra_state(self) -> dict[str, Any]:
        """The algorithm's own state (running statistics, a critic), checkpointed by the learner."""
        ...

    def load_extra_state(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """A component with state to checkpoint (an environment's curriculum, a reward's moving averages).

    Optional for environments and rewards: the trainer saves and restores the state of those that have both
    methods, and nothing for the others.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class HeldOutScoring(Protocol):
    """A reward that scores held-out rows its own way (a curriculum scores every layer, unlocked or not).

    Optional: a reward without ``evaluate`` is called on a copy for held-out scoring, so evaluation never
    advances its state.
    """

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput: ...


@runtime_checkable
class GradientCheckpointing(Protocol):
    """A policy that can recompute activations in the backward pass instead of storing them (optional)."""

    def set_gradient_checkpointing(self, on: bool) -> None: ...


@runtime_checkable
class Exportable(Protocol):
    """A policy with a transformers form (optional): ``palestra export`` and ``train.export`` write it with
    ``save_pretrained(folder, merge_lora=...)`` (``merge_lora``: fold LoRA adapters into the weights), and with
    ``dtype=`` (a ``torch.dtype``) when the user asks for one (``palestra export --dtype``); a policy that takes
    ``dtype`` writes its weights in it, and in the dtype it read them in when it is None."""

    def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True) -> None: ...


@runtime_checkable
class HeldOutSplit(Protocol):
    """An environment that keeps its own held-out tasks (a data set's evaluation split; optional). The trainer
    evaluates on ``held_out()``, which training never draws from; other environments are evaluated on a second
    instance drawing held-out seeds."""

    def held_out(self) -> Environment: ...


@runtime_checkable
class AdapterPolicy(Protocol):
    """A policy that trains adapters (LoRA) over frozen base weights (optional).

    Its frozen base is the KL reference, so no second copy of the model is made: ``base_reference()`` returns a
    module whose ``score`` runs the policy with its adapters disabled. Checkpoints hold only
    ``adapter_state_dict()`` (the trainable tensors), which ``load_adapter_state_dict`` puts back.
    """

    def base_reference(self) -> Any: ...

    def adapter_state_dict(self) -> dict[str, Any]: ...

    def load_adapter_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class FileLogger(Protocol):
    """A logger that appends to one file in the run directory (optional): checkpoints record its size, so that
    a resumed run cuts what followed the checkpoint."""

    path: Path


class Logger(Protocol):
    """A sink for scalar metrics (console, JSONL, TensorBoard, wandb, ...).

    The trainer calls ``open`` once before the first ``log`` with the run directory and the whole config as
    plain data, then ``log`` every ``train.log_every`` steps, then ``close`` (also after a failure).
    """

    def open(self, run_dir: Path, config: Mapping[str, Any]) -> None: ...

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


__all__ = [
    "DEFAULT_AGENT",
    "AdapterPolicy",
    "AgentId",
    "Environment",
    "Episode",
    "Experience",
    "Exportable",
    "FileLogger",
    "Generation",
    "Generator",
    "GradientCheckpointing",
    "HeldOutScoring",
    "HeldOutSplit",
    "Logger",
    "Message",
    "Observation",
    "Policy",
    "PolicyOptimizer",
    "Reward",
    "RewardOutput",
    "SamplingParams",
    "Stateful",
    "StepResult",
    "Turn",
]
