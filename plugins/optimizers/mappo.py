"""MAPPO (Yu et al. 2022) for language-model agents: decentralised actors, a centralised critic, per-agent everything.

**Actors** are the agents' views of a :class:`palestra.multi_agent.MultiAgentPolicy` (``agents:`` in the config;
a plain policy is one actor that every agent shares). Each row of the batch is one agent's turn, scored by that
agent's parameters. **The critic** is a separate small transformer (:mod:`._critic`) that reads the joint state
text (``metadata["state"]``: the query and every earlier agent's output) followed by the agent's completion and
gives a value per completion token; with ``ippo: true`` it reads the agent's own prompt instead (independent PPO,
for comparison). Per token the reward is the row's (credit-assigned) reward on its last token; GAE runs per
agent row (:func:`palestra.marl.per_agent_gae`), advantages are whitened per agent, the loss is PPO's clipped
surrogate minus the entropy bonus plus ``vf_coef`` times the clipped value loss.

The known multi-agent pitfalls, as features:

* **per-agent reward normalisation** (``normalize_rewards``, default on): each agent's rewards are normalised by
  that agent's running statistics, through the segmented ``normalize_rewards`` kernel (segment = agent);
* **per-agent value normalisation** (``value_norm``): the critic regresses ``(R - mean_a) / std_a``
  (:class:`palestra.marl.ValueNormalizer`) and its outputs are de-normalised per agent before GAE;
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palestra import hookimpl
from palestra.algorithm import (
    Algorithm,
    AlgorithmOptions,
    last_token_rewards,
    lr_factor,
    update_ratio,
)
from palestra.config import ConfigError, OptionError, option
from palestra.types import Experience

if TYPE_CHECKING:
    import torch


@dataclass
class MAPPOOptions(AlgorithmOptions):
    ippo: bool = False  # the critic sees only the agent's own observation (independent PPO) instead of the joint state
    gamma: float = option(1.0, ge=0, le=1)
    lam: float = option(0.95, ge=0, le=1)  # GAE lambda
    clip_eps: float = option(0.2, gt=0, lt=1)
    clip_value: float | None = option(0.2, gt=0)  # value clipping around the rollout values (normalised units); None: off
    vf_coef: float = option(1.0, ge=0)  # weight of the critic's loss (the critic has its own parameters)
    huber_delta: float | None = option(10.0, gt=0)  # Huber value loss on normalised targets (MAPPO); None: squared error
    normalize_rewards: bool = True  # per-agent running reward normalisation (normalize_rewards kernel, segment = agent)
    reward_clip: float | None = option(5.0, gt=0)  # normalised rewards clipped to +-reward_clip
    value_norm: bool = True  # per-agent value normalisation of the critic's targets
    normalize_advantages: bool = True  # whiten advantages within each agent
    per_agent_optimizer: bool = True  # a separate AdamW per agent (+ one for the shared layers); else one for the policy
    critic_lr: float | None = option(None, gt=0)  # None: train.lr
    critic_d_model: int = option(64, ge=8)
    critic_layers: int = option(2, ge=1)
    critic_heads: int = option(4, ge=1)
    critic_d_ff: int = option(128, ge=1)
    critic_max_len: int = option(512, ge=8)  # longer joint states keep their most recent tokens

    def __post_init__(self) -> None:
        if self.loss_agg != "token_mean":
            raise OptionError("loss_agg", f"mappo averages each agent's loss over its own tokens; only 'token_mean' applies, got {self.loss_agg!r}")
        if self.critic_d_model % self.critic_heads or (self.critic_d_model // self.critic_heads) % 2:
            raise OptionError("critic_heads", f"must divide critic_d_model={self.critic_d_model} into an even head size, got {self.critic_heads}")


class MAPPO(Algorithm):
    """Multi-agent PPO with a centralised critic (see the module docstring)."""

    name = "mappo"
    Options = MAPPOOptions
    options: MAPPOOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.agents: list[str] = []  # agent index = segment of the per-agent statistics
        self.reward_moments: Any = None
        self.value_normalizer: Any = None
        self.critic: Any = None
        self.optimizers: dict[str, Any] = {}
        self.groups: dict[str, list[Any]] = {}  # "shared" / agent id -> its parameters (policy only)
        self.shared_accum: list[Any] = []  # accumulated shared gradients (update_frequency window)
        self.pending = 0  # updates accumulated in shared_accum
        self.updates = 0  # optimiser updates so far (independent layers)
        self.steps = 0  # update() calls so far (the learning-rate schedule's clock)
        self.update_frequency = 1
        self.explained_var: dict[str, float] = {}

    # ---- set-up -------------------------------------------------------------------------------------------
    shared_update_window = True  # honours agents.update_frequency (palestra.multi_agent.wrap_policy checks this)

    def setup(self, policy: Any, train: Any, *, reference: Any = None) -> None:
        import torch

        from ._critic import StateCritic

        super().setup(policy, train, reference=reference)
        o = self.options
        if getattr(train, "offload_optimizer", False):
            raise ConfigError("train.offload_optimizer: the mappo optimizer keeps its optimisers on the training device; set it to false")
        if getattr(train, "precision", "fp32") == "fp16":
            raise ConfigError("train.precision: mappo has no fp16 loss scaler (its optimisers are per agent); use bf16 or fp32")
        for key in ("token_budget", "auto_micro_batch"):
            if getattr(train, key, None):
                raise ConfigError(f"train.{key}: mappo splits each update into train.grad_accum micro-batches; unset {key}")
        agents = getattr(policy, "agent_ids", None)
        if agents:
            self._register(list(agents))
        cfg = getattr(policy, "config", None)
        self.update_frequency = int(getattr(cfg, "update_frequency", 1)) if hasattr(policy, "parameter_groups") else 1
        if hasattr(policy, "parameter_groups"):
            self.groups = policy.parameter_groups()
        else:  # a plain policy: one set of parameters shared by every agent
            self.groups = {"shared": [p for p in policy.parameters() if p.requires_grad]}
        device = next(policy.parameters()).device
        self.critic = StateCritic(
            len(policy.tokenizer), d_model=o.critic_d_model, n_layers=o.critic_layers, n_heads=o.critic_heads,
            d_ff=o.critic_d_ff, max_len=o.critic_max_len,
        ).to(device)
        lr, wd = train.lr, train.weight_decay
        adamw = torch.optim.AdamW
        if o.per_agent_optimizer:
            self.optimizers = {name: adamw(params, lr=lr, weight_decay=wd) for name, params in self.groups.items()}
        else:
            self.optimizers = {"policy": adamw([p for ps in self.groups.values() for p in ps], lr=lr, weight_decay=wd)}
        self.critic_lr = o.critic_lr if o.critic_lr is not None else lr
        self.optimizers["critic"] = adamw(self.critic.parameters(), lr=self.critic_lr, weight_decay=wd)
        self.optimizer = self.optimizers.get("shared") or next(iter(self.optimizers.values()))  # the base's set-up check
        self.lr_at = lr_factor(train.lr_schedule, train.warmup_steps, train.steps)
        self.shared_accum = [torch.zeros_like(p) for p in self.groups.get("shared", [])] if self.update_frequency > 1 else []

    def _register(self, agent_ids: list[str]) -> None:
        import torch
        from palestra.kernels import RunningMoments
        from palestra.marl import ValueNormalizer

        new = [a for a in dict.fromkeys(agent_ids) if a not in self.agents]
        if not new:
            return
        if self.reward_moments is not None:
            raise ValueError(f"{self.name}: agent(s) {', '.join(new)} appeared after training started; the agents were {', '.join(self.agents)}")
        self.agents.extend(new)
        device = next(self.policy.parameters()).device if self.policy is not None else torch.device("cpu")
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
        from ._critic import encode_prefixes

        room = self.options.critic_max_len - batch.completion_ids.shape[1]
        if self.options.ippo or not batch.metadata:
            ids, mask = batch.prompt_ids, batch.prompt_mask
            if ids.shape[1] > room:  # keep the most recent tokens (left padding is at the front)
                ids, mask = ids[:, -room:], mask[:, -room:]
            return ids, mask
        states = [str(m.get("state", "")) for m in batch.metadata]
        return encode_prefixes(self.policy.tokenizer, states, room, batch.completion_ids.device)

    def critic_values(self, batch: Experience) -> torch.Tensor:
        return self.critic(batch.extras["critic_ids"], batch.extras["critic_mask"], batch.completion_ids, batch.completion_mask)

    # ---- advantages ---------------------------------------------------------------------------------------
    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import normalize_rewards
        from palestra.marl import normalize_advantages_per_agent, per_agent_gae

        o = self.options
        mask = batch.completion_mask
        idx = self.agent_index(batch)
        n = len(self.agents)
        r = batch.rewards.float()
        if o.normalize_rewards:
            r = normalize_rewards(r, self.reward_moments, segment_ids=idx, clip=o.reward_clip)
        batch.extras["critic_ids"], batch.extras["critic_mask"] = self.critic_inputs(batch)
        self.critic.eval()
        old_values = self.critic_values(batch)  # normalised units when value_norm
        vn = self.value_normalizer if o.value_norm else None
        adv, returns = per_agent_gae(last_token_rewards(r, mask), old_values, mask, idx, o.gamma, o.lam, value_normalizer=vn)
        raw_values = vn.denormalize(old_values, idx) if vn is not None else old_values
        self.explained_var = _explained_variance(raw_values, returns, mask, idx, self.agents)
        if vn is not None:
            vn.update(returns, idx, mask)
            returns = vn.normalize(returns, idx) * mask
        if o.normalize_advantages:
            adv = normalize_advantages_per_agent(adv, mask, idx, n)
        batch.advantages, batch.returns, batch.old_values = adv, returns, old_values
        return batch

    # ---- loss ---------------------------------------------------------------------------------------------
    def loss(self, policy: Any, batch: Experience, row_weight: torch.Tensor | None = None):
        """Actor + ``vf_coef`` * critic loss on ``batch``; ``row_weight [B]`` turns token sums into per-agent means
        (``1 / tokens of the row's agent in the pass``). Without it: a token mean over ``batch``."""
        import torch
        from palestra.marl import clipped_value_loss, ppo_actor_loss

        o = self.options
        if batch.returns is None or batch.old_values is None or "critic_ids" not in batch.extras:
            raise ValueError(f"{self.name}: the batch has no returns / critic inputs; run prepare() first")
        mask = batch.completion_mask
        m = mask.float()
        if row_weight is None:
            row_weight = torch.full((batch.batch_size,), 1.0 / max(1.0, float(m.sum())), device=m.device)
        scores = self.score(policy, batch)
        actor, am = ppo_actor_loss(scores.logprobs, batch.behaviour_logprobs, batch.advantages, mask, o.clip_eps)
        per_token = actor - o.entropy_coef * scores.entropy if o.entropy_coef > 0 else actor
        values = self.critic_values(batch)
        vloss, vm = clipped_value_loss(values, batch.old_values, batch.returns, mask, o.clip_value, o.huber_delta)
        w = m * row_weight[:, None]
        total = ((per_token + o.vf_coef * vloss) * w).sum()
        ent = scores.entropy.detach()
        stats = {
            "tokens": m.sum(-1), "entropy": (ent * m).sum(-1), "actor": (actor.detach() * m).sum(-1),
            "value": (vloss.detach() * m).sum(-1),
        }
        metrics = {"policy/clip_frac": am["clip_frac"], "policy/approx_kl": am["approx_kl"],
                   "policy/ratio_mean": am["ratio_mean"], "value/clip_frac": vm["value_clip_frac"]}
        return total, metrics, stats

    # ---- the update ---------------------------------------------------------------------------------------
    def _set_lr(self) -> float:
        factor = self.lr_at(self.steps)
        for name, opt in self.optimizers.items():
            base = self.critic_lr if name == "critic" else self.train.lr
            for g in opt.param_groups:
                g["lr"] = base * factor
        return self.train.lr * factor

    def update(self, policy: Any, batch: Experience) -> dict[str, float]:
        import torch
        from palestra.marl import per_agent_clip_grad_norm

        self._require_setup("update")
        if policy is not self.policy:
            raise ValueError(f"{self.name}.update: policy is not the one given to setup()")
        rows = batch
        n, k = rows.batch_size, self.train.grad_accum
        if n < k:
            raise ValueError(f"{self.name}.update: the batch has {n} rows, fewer than train.grad_accum={k} micro-batches")
        idx_all = self.agent_index(rows)
        tokens = rows.completion_mask.sum(-1).float()
        per_agent_tokens = torch.zeros(len(self.agents), device=tokens.device).index_add_(0, idx_all, tokens)
        row_weight = 1.0 / per_agent_tokens.clamp(min=1.0)[idx_all]
        lr = self._set_lr()
        shared = self.groups.get("shared", [])
        own = {a: ps for a, ps in self.groups.items() if a != "shared"}
        critic_params = list(self.critic.parameters())
        policy_params = [p for ps in self.groups.values() for p in ps]
        totals: dict[str, float] = {}
        sums = {a: {"tokens": 0.0, "entropy": 0.0, "actor": 0.0, "value": 0.0} for a in self.agents}
        passes = self.train.updates_per_batch
        skipped = 0.0
        self.critic.train()
        for _ in range(passes):
            order = torch.randperm(n, generator=self.shuffle_generator)
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            metrics: dict[str, float] = {"loss": 0.0}
            finite = True
            for chunk in torch.tensor_split(order, k):
                micro = rows.select(chunk)
                loss, micro_metrics, stats = self.loss(policy, micro, row_weight[chunk.to(row_weight.device)])
                value = float(loss.detach())
                # A non-finite loss still goes backward: its NaN gradients reach every rank through grad_sync, so
                # all ranks skip this pass together instead of one leaving the collective.
                finite = finite and math.isfinite(value)
                loss.backward()
                share = float(micro.completion_mask.sum()) / max(1.0, float(tokens.sum()))
                metrics["loss"] += value
                for key, v in self.floats(micro_metrics).items():
                    metrics[key] = metrics.get(key, 0.0) + share * v
                agent_of = idx_all[chunk.to(idx_all.device)]
                for name, per_row in stats.items():
                    per_agent = torch.zeros(len(self.agents), device=per_row.device).index_add_(0, agent_of, per_row.float())
                    for a, v in zip(self.agents, per_agent.tolist()):
                        sums[a][name] += v / passes
            sync = getattr(self, "grad_sync", None)
            if sync is not None:
                sync(policy_params + critic_params)
            max_norm = self.train.max_grad_norm if self.train.max_grad_norm is not None else math.inf
            norms = per_agent_clip_grad_norm(own, max_norm) if own else {}
            norms["critic"] = per_agent_clip_grad_norm({"critic": critic_params}, max_norm)["critic"]
            shared_norm = math.sqrt(sum(float(p.grad.detach().float().square().sum()) for p in shared if p.grad is not None))
            if not finite or not all(math.isfinite(v) for v in [*norms.values(), shared_norm]):
                for opt in self.optimizers.values():
                    opt.zero_grad(set_to_none=True)
                skipped = 1.0
                continue
            stepped_shared = self._shared_step_due()
            if shared and self.update_frequency > 1:  # accumulate; the shared layers step on the window's last update
                for p, acc in zip(shared, self.shared_accum):
                    if p.grad is not None:
                        acc.add_(p.grad)
                    p.grad = None
                if stepped_shared:
                    for p, acc in zip(shared, self.shared_accum):
                        p.grad = acc / self.update_frequency
            if shared and stepped_shared:
                norms["shared_step"] = float(torch.nn.utils.clip_grad_norm_([p for p in shared if p.grad is not None], max_norm))
            track = self.train.track_update_ratio
            before = [p.detach().clone() for p in policy_params] if track else []
            for opt in self.optimizers.values():
                opt.step()  # parameters without a gradient (the shared ones between their steps) are left alone
                opt.zero_grad(set_to_none=True)
            self.updates += 1
            self.pending = 0 if stepped_shared else self.pending + 1
            if stepped_shared and self.shared_accum:
                for acc in self.shared_accum:
                    acc.zero_()
            metrics["grad/norm/shared"] = shared_norm
            metrics["shared/stepped"] = 1.0 if stepped_shared else 0.0
            for a, v in norms.items():
                if a != "shared_step":
                    metrics[f"grad/norm/{a}"] = v
            metrics["grad/norm"] = math.sqrt(sum(v * v for a, v in norms.items() if a not in ("critic", "shared_step")) + shared_norm**2)
            if track:
                metrics["grad/update_ratio"] = update_ratio(before, policy_params)
            for key, v in metrics.items():
                totals[key] = totals.get(key, 0.0) + v / passes
        self.steps += 1
        all_tokens = max(1.0, sum(s["tokens"] for s in sums.values()))
        totals["policy/entropy"] = sum(s["entropy"] for s in sums.values()) / all_tokens
        totals["value/loss"] = sum(s["value"] for s in sums.values()) / all_tokens
        for a, s in sums.items():
            if s["tokens"] > 0:
                totals[f"policy/entropy/{a}"] = s["entropy"] / s["tokens"]
                totals[f"policy/loss/{a}"] = s["actor"] / s["tokens"]
        totals.update({f"value/explained_var/{a}": v for a, v in self.explained_var.items() if a != "all"})
        totals["value/explained_var"] = self.explained_var.get("all", 0.0)
        totals["train/skipped"] = skipped
        totals["lr"] = lr
        return totals

    def _shared_step_due(self) -> bool:
        return self.pending + 1 >= self.update_frequency

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._require_setup("state_dict")
        return {
            "optimizers": {k: v.state_dict() for k, v in self.optimizers.items()},
            "critic": self.critic.state_dict(),
            "agents": list(self.agents),
            "reward_moments": self.reward_moments.state_dict() if self.reward_moments is not None else None,
            "value_normalizer": self.value_normalizer.state_dict() if self.value_normalizer is not None else None,
            "shared_accum": [a.clone() for a in self.shared_accum],
            "counters": {"pending": self.pending, "updates": self.updates, "steps": self.steps},
            "shuffle_generator": self.shuffle_generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._require_setup("load_state_dict")
        want = {"optimizers", "critic", "agents", "reward_moments", "value_normalizer", "shared_accum", "counters", "shuffle_generator"}
        if set(state) != want:
            raise KeyError(f"{self.name}.load_state_dict: missing keys {sorted(want - set(state))}, unexpected keys {sorted(set(state) - want)}")
        if set(state["optimizers"]) != set(self.optimizers):
            raise KeyError(f"{self.name}.load_state_dict: optimisers {sorted(state['optimizers'])} saved, {sorted(self.optimizers)} here "
                           "(optimizer.options.per_agent_optimizer or the agents differ)")
        for k, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][k])
        self.critic.load_state_dict(state["critic"])
        self.agents, self.reward_moments, self.value_normalizer = [], None, None
        if state["agents"]:
            self._register(list(state["agents"]))
            if state["reward_moments"] is not None:
                self.reward_moments.load_state_dict(state["reward_moments"])
            if state["value_normalizer"] is not None:
                self.value_normalizer.load_state_dict(state["value_normalizer"])
        if len(state["shared_accum"]) != len(self.shared_accum):
            raise KeyError(f"{self.name}.load_state_dict: {len(state['shared_accum'])} accumulated shared gradients saved, "
                           f"{len(self.shared_accum)} here (agents.update_frequency or the sharing differ)")
        for acc, saved in zip(self.shared_accum, state["shared_accum"]):
            acc.copy_(saved)
        c = state["counters"]
        self.pending, self.updates, self.steps = int(c["pending"]), int(c["updates"]), int(c["steps"])
        self.shuffle_generator.set_state(state["shuffle_generator"])


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor,
                        agents: list[str]) -> dict[str, float]:
    """``1 - Var(R - V) / Var(R)`` over valid tokens, for all rows (``"all"``) and per agent (0 when Var(R) is 0)."""
    def ev(sel: torch.Tensor) -> float:
        r, v = returns[sel].double(), values[sel].double()
        if r.numel() < 2 or float(r.var(unbiased=False)) <= 1e-12:
            return 0.0
        return float(1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False))

    out = {"all": ev(mask)}
    for i, a in enumerate(agents):
        out[a] = ev(mask & (idx == i)[:, None])
    return out


@hookimpl
def register_optimizers(register: Any) -> None:
    register("mappo", MAPPO, options=MAPPOOptions,
             description="MAPPO: per-agent actors, centralised critic over the joint state (ippo: own observation), "
                         "per-agent GAE, value and reward normalisation, clipping and optimisers")
