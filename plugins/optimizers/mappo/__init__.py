"""MAPPO (Yu et al. 2022) for language-model agents: decentralised actors, a centralised critic, per-agent everything.

**Actors** are the agents' views of a :class:`palestra.multiagent.sharing.MultiAgentPolicy` (``agents:`` in the config;
a plain policy is one actor that every agent shares). Each row of the batch is one agent's turn, scored by that
agent's parameters. **The critic** is a separate small transformer (:mod:`.critic`) that reads the joint state
text (``metadata["state"]``: the query and every earlier agent's output) followed by the agent's completion and
gives a value per completion token; with ``ippo: true`` it reads the agent's own prompt instead (independent PPO,
for comparison). Per token the reward is the row's (credit-assigned) reward on its last token; GAE runs per
agent row (:func:`.per_agent.per_agent_gae`), advantages are whitened per agent, the loss is PPO's clipped
surrogate minus the entropy bonus plus ``vf_coef`` times the clipped value loss (both from :mod:`palestra.rl`).

MAPPO runs on the one learner (:class:`palestra.engine.learner.Learner`), which does its forward, micro-batches,
mixed precision (fp16 loss scaling too), CPU offload and FSDP2 as for every other algorithm. What MAPPO states
differently, through the algorithm's hooks: its parameter groups (:meth:`MAPPO.optimizer_groups`: one per agent, the
shared layers, the critic), per-agent clipping (:meth:`MAPPO.clip_gradients`), per-agent token means
(:meth:`MAPPO.begin_update` sets the row weights, :meth:`MAPPO.micro_weights` counts every micro-batch as 1) and the
shared-layer update window (:meth:`MAPPO.on_optimizers`, :meth:`MAPPO.before_optimizer_step`,
:meth:`MAPPO.after_optimizer_step`). Its critic is its own network, which it runs itself. Under torchrun the per-agent
running statistics (reward moments, value normaliser) are merged over ranks every step, so every rank normalises with
the global batch's statistics.

The known multi-agent pitfalls, as features:

* **per-agent reward normalisation** (``normalize_rewards``, default on): each agent's rewards are normalised by
  that agent's running statistics, through the segmented ``normalize_rewards`` kernel (segment = agent);
* **per-agent value normalisation** (``value_norm``): the critic regresses ``(R - mean_a) / std_a``, and its
  outputs are de-normalised per agent before GAE
  (:class:`palestra.plugins.optimizers.mappo.per_agent.ValueNormalizer`);
* **per-agent loss weighting**: each agent's loss is the mean over its own tokens, and the agents' losses are
  summed: a verbose agent (long replies) does not outweigh a terse one (a one-token label);
* **per-agent gradient clipping** (always): every agent's own parameters, the shared parameters and the critic
  are clipped to ``train.max_grad_norm`` separately; ``per_agent_optimizer`` gives each its own AdamW;
* **per-agent metrics**: ``policy/entropy/<agent>``, ``grad/norm/<agent>``, ``value/explained_var/<agent>``
  (and the trainer's ``reward/agent/<agent>``), so that a stalled agent shows.

``update_frequency`` (``agents.update_frequency``): an *update* is one optimiser step of the independent layers
(``train.updates_per_batch`` of them per training step). The shared layers' gradients, from every agent,
accumulate over ``update_frequency`` updates and then take one step with their mean (clipped on its own); 1 is
ordinary sharing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import Algorithm, AlgorithmOptions, Experience, OptionError, ParamGroup, hookimpl, option

if TYPE_CHECKING:
    import torch


@dataclass
class MAPPOOptions(AlgorithmOptions):
    ippo: bool = False  # the critic sees only the agent's own observation (independent PPO) instead of the joint state
    gamma: float = option(1.0, ge=0, le=1)
    lam: float = option(0.95, ge=0, le=1)  # GAE lambda
    clip_eps: float = option(0.2, gt=0, lt=1)
    clip_value: float | None = option(
        0.2, gt=0
    )  # value clipping around the rollout values (normalised units); None: off
    vf_coef: float = option(1.0, ge=0)  # weight of the critic's loss (the critic has its own parameters)
    huber_delta: float | None = option(
        10.0, gt=0
    )  # Huber value loss on normalised targets (MAPPO); None: squared error
    normalize_rewards: bool = True  # per-agent running reward normalisation (normalize_rewards kernel, segment = agent)
    reward_clip: float | None = option(5.0, gt=0)  # normalised rewards clipped to +-reward_clip
    value_norm: bool = True  # per-agent value normalisation of the critic's targets
    normalize_advantages: bool = True  # whiten advantages within each agent
    per_agent_optimizer: bool = (
        True  # a separate AdamW per agent (+ one for the shared layers); else one for the policy
    )
    critic_lr: float | None = option(None, gt=0)  # None: train.lr
    critic_d_model: int = option(64, ge=8)
    critic_layers: int = option(2, ge=1)
    critic_heads: int = option(4, ge=1)
    critic_d_ff: int = option(128, ge=1)
    critic_max_len: int = option(512, ge=8)  # longer joint states keep their most recent tokens

    def __post_init__(self) -> None:
        if self.loss_agg != "token_mean":
            raise OptionError(
                "loss_agg",
                "mappo averages each agent's loss over its own tokens; "
                f"only 'token_mean' applies, got {self.loss_agg!r}",
            )
        if self.critic_d_model % self.critic_heads or (self.critic_d_model // self.critic_heads) % 2:
            raise OptionError(
                "critic_heads",
                f"must divide critic_d_model={self.critic_d_model} into an even head size, got {self.critic_heads}",
            )


class MAPPO(Algorithm):
    """Multi-agent PPO with a centralised critic (see the module docstring)."""

    name = "mappo"
    Options = MAPPOOptions
    options: MAPPOOptions
    shared_update_window = True  # honours agents.update_frequency (palestra.multiagent.sharing.wrap_policy checks this)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.agents: list[str] = []  # agent index = segment of the per-agent statistics
        self.reward_moments: Any = None
        self.value_normalizer: Any = None
        self.critic: Any = None
        self.sharing: dict[str, list[Any]] = {}  # "shared" / agent id -> its policy parameters
        self.shared_accum: list[Any] = []  # accumulated shared gradients (update_frequency window)
        self.pending = 0  # updates accumulated in shared_accum
        self.updates = 0  # optimiser updates so far (independent layers)
        self.update_frequency = 1
        self.explained_var: dict[str, float] = {}
        self._stepped_by_group: dict[str, list[Any]] = {}  # sharing group -> the tensors its optimiser steps
        self.tokenizer: Any = None  # the policy's (the critic reads the joint state in its tokens)
        self.device: Any = None  # where the policy, the critic and the running statistics live
        self._shared_due = False
        self._sums: dict[str, dict[str, float]] = {}

    # ---- set-up (learner hooks) -----------------------------------------------------------------------
    def on_setup(self, policy: Any) -> None:
        from palestra.multiagent.sharing import MultiAgentPolicy

        from .critic import StateCritic

        o = self.options
        self.tokenizer, self.device = policy.tokenizer, next(policy.parameters()).device
        multi = isinstance(policy, MultiAgentPolicy)
        if multi:
            self._register(list(policy.agent_ids))
            self.update_frequency = int(policy.config.update_frequency)
            self.sharing = policy.parameter_groups()
        else:  # a plain policy: one set of parameters shared by every agent
            self.update_frequency = 1
            self.sharing = {"shared": [p for p in policy.parameters() if p.requires_grad]}
        device = self.device
        self.critic = StateCritic(
            len(policy.tokenizer),
            d_model=o.critic_d_model,
            n_layers=o.critic_layers,
            n_heads=o.critic_heads,
            d_ff=o.critic_d_ff,
            max_len=o.critic_max_len,
        ).to(device)

    def optimizer_groups(self, policy: Any) -> dict[str, ParamGroup]:
        lr = self.train.lr
        if self.options.per_agent_optimizer:
            groups = {name: ParamGroup(list(ps), lr, policy) for name, ps in self.sharing.items()}
        else:
            groups = {"policy": ParamGroup([p for ps in self.sharing.values() for p in ps], lr, policy)}
        critic_lr = self.options.critic_lr if self.options.critic_lr is not None else lr
        groups["critic"] = ParamGroup(list(self.critic.parameters()), critic_lr, self.critic, policy=False)
        return groups

    def on_optimizers(self, stepped: Mapping[str, Sequence[Any]]) -> None:
        """Each sharing group's stepped tensors (one optimiser's, or its slice of the one ``policy`` optimiser's), and
        the shared layers' gradient accumulators for the update window."""
        import torch

        if self.options.per_agent_optimizer:
            self._stepped_by_group = {name: list(stepped[name]) for name in self.sharing}
        else:  # the "policy" group holds the sharing groups' parameters one after another (optimizer_groups)
            tensors, start = list(stepped["policy"]), 0
            self._stepped_by_group = {}
            for name, ps in self.sharing.items():
                self._stepped_by_group[name] = tensors[start : start + len(ps)]
                start += len(ps)
        shared = self._stepped("shared")
        self.shared_accum = [torch.zeros_like(t) for t in shared] if self.update_frequency > 1 else []

    def _stepped(self, name: str) -> list[Any]:
        """The tensors the optimisers step for one sharing group (the parameters, or their CPU master copies)."""
        return self._stepped_by_group.get(name, [])

    def _register(self, agent_ids: list[str]) -> None:
        import torch

        from palestra.kernels import RunningMoments

        from .per_agent import ValueNormalizer

        new = [a for a in dict.fromkeys(agent_ids) if a not in self.agents]
        if not new:
            return
        if self.reward_moments is not None:
            raise ValueError(
                f"{self.name}: agent(s) {', '.join(new)} appeared after "
                f"training started; the agents were {', '.join(self.agents)}"
            )
        self.agents.extend(new)
        device = self.device if self.device is not None else torch.device("cpu")
        self.reward_moments = RunningMoments(num_segments=len(self.agents), device=device)
        self.value_normalizer = ValueNormalizer(len(self.agents), device=device)

    def agent_index(self, batch: Experience) -> torch.Tensor:
        import torch

        self._register(list(batch.agent_ids))
        where = {a: i for i, a in enumerate(self.agents)}
        return torch.tensor([where[a] for a in batch.agent_ids], dtype=torch.int64, device=batch.completion_ids.device)

    # ---- scoring ------------------------------------------------------------------------------------------
    def critic_inputs(self, batch: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """The critic's prefix: the joint state text (``metadata["state"]``) or, for IPPO, the agent's own prompt."""
        from .critic import encode_prefixes

        room = self.options.critic_max_len - batch.completion_ids.shape[1]
        if self.options.ippo or not batch.metadata:
            ids, mask = batch.prompt_ids, batch.prompt_mask
            if ids.shape[1] > room:  # keep the most recent tokens (left padding is at the front)
                ids, mask = ids[:, -room:], mask[:, -room:]
            return ids, mask
        states = [str(m.get("state", "")) for m in batch.metadata]
        return encode_prefixes(self.tokenizer, states, room, batch.completion_ids.device)

    def critic_values(self, batch: Experience) -> torch.Tensor:
        return self.critic(
            batch.extras["critic_ids"], batch.extras["critic_mask"], batch.completion_ids, batch.completion_mask
        )

    # ---- advantages ---------------------------------------------------------------------------------------
    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import normalize_rewards
        from palestra.rl import last_token_rewards

        from .per_agent import normalize_advantages_per_agent, per_agent_gae

        o = self.options
        mask = batch.completion_mask
        dist = self.context.distributed if self.context.is_distributed else None
        if dist is not None:  # every rank registers every rank's agents, in one order
            for part in dist.all_gather_object(list(dict.fromkeys(batch.agent_ids))):
                self._register(part)
        idx = self.agent_index(batch)
        n = len(self.agents)
        r = batch.rewards.float()
        if o.normalize_rewards and dist is not None:
            # Fold this rank's rows in, merge the ranks' moments (exact Chan merge, identical on every rank), then
            # normalise with them: the statistics one process would have over the global batch.
            self.reward_moments.update(r, idx)
            dist.merge_moments(self.reward_moments)
            r = normalize_rewards(r, self.reward_moments, segment_ids=idx, clip=o.reward_clip, update=False)
        elif o.normalize_rewards:
            r = normalize_rewards(r, self.reward_moments, segment_ids=idx, clip=o.reward_clip)
        batch.extras["critic_ids"], batch.extras["critic_mask"] = self.critic_inputs(batch)
        self.critic.eval()
        old_values = self.critic_values(batch)  # normalised units when value_norm
        vn = self.value_normalizer if o.value_norm else None
        adv, returns = per_agent_gae(
            last_token_rewards(r, mask), old_values, mask, idx, o.gamma, o.lam, value_normalizer=vn
        )
        raw_values = vn.denormalize(old_values, idx) if vn is not None else old_values
        self.explained_var = _explained_variance(raw_values, returns, mask, idx, self.agents)
        if vn is not None:
            vn.update(returns, idx, mask)
            if dist is not None:
                dist.merge_moments(vn.moments)
            returns = vn.normalize(returns, idx) * mask
        if o.normalize_advantages:
            adv = normalize_advantages_per_agent(adv, mask, idx, n)
        batch.advantages, batch.returns, batch.old_values = adv, returns, old_values
        return batch

    # ---- loss ---------------------------------------------------------------------------------------------
    def begin_update(self, rows: Experience) -> None:
        """Per-agent loss weights: each row's tokens count ``1 / (tokens of its agent in the update)``, so each
        agent's loss is the mean over its own tokens and the agents' losses add up (micro-batches weigh 1)."""
        import torch

        idx = self.agent_index(rows)
        tokens = rows.completion_mask.sum(-1).float()
        per_agent_tokens = torch.zeros(len(self.agents), device=tokens.device).index_add_(0, idx, tokens)
        rows.extras["row_weight"] = 1.0 / per_agent_tokens.clamp(min=1.0)[idx]
        rows.extras["agent_index"] = idx
        self._sums = {a: {"tokens": 0.0, "entropy": 0.0, "actor": 0.0, "value": 0.0} for a in self.agents}
        self.critic.train()

    def micro_weights(self, batch: Experience, chunks: Sequence[torch.Tensor]) -> list[float]:
        return [1.0] * len(chunks)  # the per-agent row weights already make each micro-batch's share

    def loss(self, batch: Experience, scores: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Actor + ``vf_coef`` * critic loss on ``batch``, weighted per row by ``extras["row_weight"]`` (set by
        :meth:`begin_update`); without it, a token mean over ``batch``. The actor's ratio is against
        ``batch.old_logprobs`` and its advantages carry rollout correction's weights (the learner's)."""
        import torch

        from palestra.rl import clipped_surrogate, value_loss

        o = self.options
        if batch.returns is None or batch.old_values is None or "critic_ids" not in batch.extras:
            raise ValueError(f"{self.name}: the batch has no returns / critic inputs; run prepare() first")
        mask = batch.completion_mask
        m = mask.float()
        row_weight = batch.extras.get("row_weight")
        if row_weight is None:
            row_weight = torch.full((batch.batch_size,), 1.0 / max(1.0, float(m.sum())), device=m.device)
        actor, am = clipped_surrogate(scores.logprobs, batch.old_logprobs, batch.advantages, mask, o.clip_eps)
        metrics: dict[str, Any] = {}
        per_token = actor - o.entropy_coef * scores.entropy if o.entropy_coef > 0 else actor
        values = self.critic_values(batch)
        vloss, vm = value_loss(values, batch.old_values, batch.returns, mask, o.clip_value, o.huber_delta)
        w = m * row_weight[:, None]
        total = ((per_token + o.vf_coef * vloss) * w).sum()
        if "agent_index" in batch.extras:
            self._add_agent_stats(
                batch.extras["agent_index"],
                {
                    "tokens": m.sum(-1),
                    "entropy": (scores.entropy.detach() * m).sum(-1),
                    "actor": (actor.detach() * m).sum(-1),
                    "value": (vloss.detach() * m).sum(-1),
                },
            )
        metrics |= {
            "policy/clip_frac": am["clip_frac"],
            "policy/approx_kl": am["approx_kl"],
            "policy/ratio_mean": am["ratio_mean"],
            "value/clip_frac": vm["value_clip_frac"],
        }
        return total, metrics

    def _add_agent_stats(self, agent_of: torch.Tensor, stats: Mapping[str, torch.Tensor]) -> None:
        import torch

        passes = self.train.updates_per_batch
        for name, per_row in stats.items():
            per_agent = torch.zeros(len(self.agents), device=per_row.device).index_add_(0, agent_of, per_row.float())
            for a, v in zip(self.agents, per_agent.tolist()):
                self._sums[a][name] += v / passes

    # ---- clipping and the shared-layer window (learner hooks) -----------------------------------------------
    def clip_gradients(self, groups: Mapping[str, Sequence[Any]], max_norm: float) -> tuple[float, dict[str, float]]:
        """Every agent's own parameters and the critic clipped separately; the shared layers' norm reported (they
        are clipped when they step, see :meth:`before_optimizer_step`). ``grad/norm`` is the policy's total."""
        from .per_agent import per_agent_clip_grad_norm

        own = {a: self._stepped(a) for a in self.sharing if a != "shared"}
        norms = per_agent_clip_grad_norm(own, max_norm) if own else {}
        norms["critic"] = per_agent_clip_grad_norm({"critic": list(groups["critic"])}, max_norm)["critic"]
        shared_norm = math.sqrt(
            sum(float(t.grad.detach().float().square().sum()) for t in self._stepped("shared") if t.grad is not None)
        )
        metrics = {"grad/norm/shared": shared_norm, **{f"grad/norm/{a}": v for a, v in norms.items()}}
        total = math.sqrt(sum(v * v for a, v in norms.items() if a != "critic") + shared_norm**2)
        return total, metrics

    def before_optimizer_step(self, groups: Mapping[str, Sequence[Any]], max_norm: float) -> dict[str, float]:
        """``agents.update_frequency``: the shared layers' gradients accumulate over that many updates, then step
        once with their mean, clipped on its own; between their steps they have no gradient (AdamW skips them)."""
        import torch

        shared = self._stepped("shared")
        self._shared_due = self.pending + 1 >= self.update_frequency
        if shared and self.update_frequency > 1:
            for t, acc in zip(shared, self.shared_accum):
                if t.grad is not None:
                    acc.add_(t.grad)
                t.grad = None
            if self._shared_due:
                for t, acc in zip(shared, self.shared_accum):
                    t.grad = acc / self.update_frequency
        if shared and self._shared_due:
            torch.nn.utils.clip_grad_norm_([t for t in shared if t.grad is not None], max_norm)
        return {"shared/stepped": 1.0 if self._shared_due else 0.0}

    def after_optimizer_step(self, took: bool) -> None:
        self.updates += 1
        self.pending = 0 if self._shared_due else self.pending + 1
        if self._shared_due:
            for acc in self.shared_accum:
                acc.zero_()

    def update_metrics(self) -> dict[str, float]:
        sums = self._sums
        out: dict[str, float] = {}
        all_tokens = max(1.0, sum(s["tokens"] for s in sums.values()))
        out["policy/entropy"] = sum(s["entropy"] for s in sums.values()) / all_tokens
        out["value/loss"] = sum(s["value"] for s in sums.values()) / all_tokens
        for a, s in sums.items():
            if s["tokens"] > 0:
                out[f"policy/entropy/{a}"] = s["entropy"] / s["tokens"]
                out[f"policy/loss/{a}"] = s["actor"] / s["tokens"]
        out.update({f"value/explained_var/{a}": v for a, v in self.explained_var.items() if a != "all"})
        out["value/explained_var"] = self.explained_var.get("all", 0.0)
        return out

    # ---- checkpoints --------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "critic": self.critic.state_dict(),
            "agents": list(self.agents),
            "reward_moments": self.reward_moments.state_dict() if self.reward_moments is not None else None,
            "value_normalizer": self.value_normalizer.state_dict() if self.value_normalizer is not None else None,
            "shared_accum": [_full(a) for a in self.shared_accum],
            "counters": {"pending": self.pending, "updates": self.updates},
        }

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        want = {"critic", "agents", "reward_moments", "value_normalizer", "shared_accum", "counters"}
        if set(state) != want:
            raise KeyError(
                f"{self.name}.load_state_dict: missing keys {sorted(want - set(state))}, "
                f"unexpected keys {sorted(set(state) - want)}"
            )
        self.critic.load_state_dict(state["critic"])
        self.agents, self.reward_moments, self.value_normalizer = [], None, None
        if state["agents"]:
            self._register(list(state["agents"]))
            if state["reward_moments"] is not None:
                self.reward_moments.load_state_dict(state["reward_moments"])
            if state["value_normalizer"] is not None:
                self.value_normalizer.load_state_dict(state["value_normalizer"])
        if len(state["shared_accum"]) != len(self.shared_accum):
            raise KeyError(
                f"{self.name}.load_state_dict: {len(state['shared_accum'])} accumulated shared gradients saved, "
                f"{len(self.shared_accum)} here (agents.update_frequency or the sharing differ)"
            )
        for acc, saved in zip(self.shared_accum, state["shared_accum"]):
            _load_full(acc, saved)
        c = state["counters"]
        self.pending, self.updates = int(c["pending"]), int(c["updates"])


def _full(t: Any) -> Any:
    """A copy of ``t`` as one whole tensor: an FSDP2 shard (DTensor) is gathered (collective), so the checkpoint holds
    plain tensors that every rank, or another world size, can read."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _load_full(target: Any, saved: Any) -> None:
    """Copy a whole saved tensor into ``target``, keeping only this rank's shard when ``target`` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        saved = distribute_tensor(saved.to(target.device_mesh.device_type), target.device_mesh, target.placements)
    target.copy_(saved)


def _explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, agents: list[str]
) -> dict[str, float]:
    """:func:`palestra.rl.explained_variance` for all rows (``"all"``) and per agent."""
    from palestra.rl import explained_variance

    out = {"all": explained_variance(values, returns, mask)}
    for i, a in enumerate(agents):
        out[a] = explained_variance(values, returns, mask & (idx == i)[:, None])
    return out


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "mappo",
        MAPPO,
        options=MAPPOOptions,
        description="MAPPO: per-agent actors, centralised critic over the joint state (ippo: own observation), "
        "per-agent GAE, value and reward normalisation, clipping and optimisers",
    )
