"""MAPPO's per-agent math: value normalisation, GAE, advantage whitening and gradient clipping, each per agent.

Everything here is model-agnostic tensor math, shared by the LLM MAPPO optimiser
(:mod:`palestra.plugins.optimizers.mappo`) and the small-MLP standard check (``bench/mpe_simple_spread.py``).

Conventions:

* A batch is a set of **rows**, one per agent trajectory (or one per agent turn): ``[B, T]`` tensors with a
  ``mask`` marking valid steps/tokens, and ``agent_index [B]`` (int) saying which agent each row belongs to.
  Where an ``agent_index`` is accepted, it may also have the full ``[B, T]`` shape.
* The per-agent pieces exist because agents differ in reward scale and in how fast they learn: one agent's
  large returns or gradients must not swamp another's (MAPPO, Yu et al. 2022, "The Surprising Effectiveness
  of PPO in Cooperative Multi-Agent Games": value normalisation and per-agent GAE are two of its five
  implementation details that matter).
* All math runs in float32 (inputs of other float dtypes are cast; running statistics are float64, as in
  :class:`palestra.kernels.RunningMoments`). Losses keep the autograd graph of ``logp`` / ``values``; every
  other input is treated as data.
* The losses (clipped surrogate, Huber value loss) are the shared ones of :mod:`palestra.rl`.
* Bad input raises a one-line ``ValueError`` / ``TypeError`` naming the function, the tensor and its shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TypeVar

import torch

from palestra.kernels import RunningMoments, gae
from palestra.rl.checks import FLOAT_DTYPES as _FLOATS
from palestra.rl.checks import INT_DTYPES as _INTS
from palestra.rl.checks import as_mask as _mask
from palestra.rl.checks import check_same_shape as _same_shape
from palestra.rl.checks import check_tensor as _tensor
from palestra.rl.checks import shape_str as _shape

__all__ = [
    "ValueNormalizer",
    "normalize_advantages_per_agent",
    "per_agent_clip_grad_norm",
    "per_agent_gae",
    "per_agent_mean",
]


# ---- input checks (one-line errors; palestra.rl.checks) --------------------------------------------------
def _agent_ids(fn: str, agent_index, ref_name: str, ref: torch.Tensor, num_agents: int | None = None) -> torch.Tensor:
    """``agent_index`` ([B] per row, or the full shape of ``ref``) broadcast to ``ref``'s shape, as int64."""
    _tensor(fn, "agent_index", agent_index, _INTS)
    if agent_index.device != ref.device:
        raise ValueError(f"{fn}: agent_index is on {agent_index.device} but {ref_name} is on {ref.device}")
    if agent_index.shape == ref.shape:
        ids = agent_index
    elif ref.dim() >= 1 and agent_index.dim() == 1 and agent_index.shape[0] == ref.shape[0]:
        ids = agent_index.reshape((-1,) + (1,) * (ref.dim() - 1)).expand(ref.shape)
    else:
        want = f"[{ref.shape[0]}] or {_shape(ref)}" if ref.dim() >= 1 else _shape(ref)
        raise ValueError(
            f"{fn}: agent_index has shape {_shape(agent_index)}, expected {want} (one id per row of {ref_name})"
        )
    ids = ids.detach().to(torch.int64)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (num_agents is not None and hi >= num_agents):
            bad = lo if lo < 0 else hi
            bound = f"[0, {num_agents})" if num_agents is not None else ">= 0"
            raise ValueError(f"{fn}: agent_index has value {bad}; ids must lie in {bound}")
    return ids


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def per_agent_mean(
    x: torch.Tensor, mask: torch.Tensor | None, agent_index: torch.Tensor, num_agents: int
) -> torch.Tensor:
    """Per-agent mean of ``x`` over valid positions: float32 ``[num_agents]``, detached (0 for an agent with no
    valid position). For per-agent metrics (entropy, reward, clip fraction) so that a stalled agent shows."""
    fn = "per_agent_mean"
    _tensor(fn, "x", x, _FLOATS)
    m = _mask(fn, mask, "x", x)
    ids = _agent_ids(fn, agent_index, "x", x, num_agents)
    w = m.reshape(-1).to(torch.float32)
    total = torch.zeros(num_agents, dtype=torch.float32, device=x.device).index_add_(
        0, ids.reshape(-1), x.detach().reshape(-1).to(torch.float32) * w
    )
    count = torch.zeros(num_agents, dtype=torch.float32, device=x.device).index_add_(0, ids.reshape(-1), w)
    return total / count.clamp(min=1.0)


# ---- value normalisation ------------------------------------------------------------------------------------
class ValueNormalizer:
    """Per-agent running mean and variance of value targets (returns), to train critics on a unit scale.

    Why: returns grow and shift as the policy improves, and agents (roles) see different reward scales; a
    critic regressing raw returns has badly scaled gradients and its loss drowns the actor's. MAPPO's
    "PopArt-lite" value normalisation trains the critic on ``(R - mean_a) / std_a`` and de-normalises its
    outputs before GAE.

    Statistics are **exact** running moments (count, mean, M2 in float64, Chan's parallel merge) held in a
    :class:`palestra.kernels.RunningMoments` with one segment per agent, not MAPPO's EMA with
    ``beta=0.99999`` (which approximates them). Consequences: merging across data-parallel ranks is exact
    (:meth:`all_reduce`, or ``DistributedContext.merge_moments(normalizer.moments)``) and
    ``state_dict`` / ``load_state_dict`` round-trip bit for bit.

    An agent with no samples yet normalises as the identity (mean 0, std 1). ``std`` is
    ``sqrt(var + eps)`` with the population variance.
    """

    def __init__(self, num_agents: int, eps: float = 1e-5, device: torch.device | str = "cpu"):
        if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
            raise ValueError(f"ValueNormalizer: num_agents must be an int >= 1, got {num_agents!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < math.inf):
            raise ValueError(f"ValueNormalizer: eps must be a finite float > 0, got {eps!r}")
        self.num_agents = num_agents
        self.eps = float(eps)
        self.moments = RunningMoments(num_segments=num_agents, device=device)

    @property
    def device(self) -> torch.device:
        return self.moments.device

    @property
    def count(self) -> torch.Tensor:
        return self.moments.count

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-agent ``(mean, std)`` as float32 ``[num_agents]``; ``(0, 1)`` for an agent with no samples."""
        m = self.moments
        has = m.count > 0
        var = m.m2 / torch.where(has, m.count, torch.ones_like(m.count))
        mean = torch.where(has, m.mean, torch.zeros_like(m.mean))
        std = torch.where(has, torch.sqrt(var + self.eps), torch.ones_like(var))
        return mean.to(torch.float32), std.to(torch.float32)

    def update(
        self, returns: torch.Tensor, agent_index: torch.Tensor, mask: torch.Tensor | None = None
    ) -> ValueNormalizer:
        """Fold value targets into the statistics of their agents.

        ``returns`` is ``[N]`` or ``[B, T]``; ``agent_index`` has its shape or ``[B]`` (one id per row);
        ``mask`` (optional, the shape of ``returns``) selects the valid targets. Must be finite.
        """
        fn = "ValueNormalizer.update"
        _tensor(fn, "returns", returns, _FLOATS)
        ids = _agent_ids(fn, agent_index, "returns", returns, self.num_agents)
        m = _mask(fn, mask, "returns", returns)
        if returns.device != self.device:
            raise ValueError(
                f"{fn}: returns {_shape(returns)} is on {returns.device} but the normalizer is on {self.device}"
            )
        x = returns.detach()[m].to(torch.float64)
        if x.numel():
            self.moments.update(x, ids[m])
        return self

    def normalize(self, x: torch.Tensor, agent_index: torch.Tensor) -> torch.Tensor:
        """``(x - mean_a) / std_a`` for each element's agent ``a``, float32 (differentiable in ``x``)."""
        return self._affine("ValueNormalizer.normalize", x, agent_index, inverse=False)

    def denormalize(self, x: torch.Tensor, agent_index: torch.Tensor) -> torch.Tensor:
        """``x * std_a + mean_a``: a normalised critic output back in return units, float32."""
        return self._affine("ValueNormalizer.denormalize", x, agent_index, inverse=True)

    def _affine(self, fn: str, x: torch.Tensor, agent_index: torch.Tensor, inverse: bool) -> torch.Tensor:
        _tensor(fn, "x", x, _FLOATS)
        if x.device != self.device:
            raise ValueError(f"{fn}: x {_shape(x)} is on {x.device} but the normalizer is on {self.device}")
        ids = _agent_ids(fn, agent_index, "x", x, self.num_agents)
        mean, std = self.stats()
        mu, sd = mean[ids], std[ids]
        x = _f32(x)
        return x * sd + mu if inverse else (x - mu) / sd

    def all_reduce(self, group=None) -> ValueNormalizer:
        """Merge the statistics of every ``torch.distributed`` rank exactly (no-op when not initialised)."""
        self.moments.all_reduce(group)
        return self

    def state_dict(self) -> dict:
        return {"num_agents": self.num_agents, "eps": self.eps, "moments": self.moments.state_dict()}

    def load_state_dict(self, state_dict: Mapping) -> None:
        n = state_dict.get("num_agents", self.num_agents)
        if n != self.num_agents:
            raise ValueError(
                f"ValueNormalizer.load_state_dict: state_dict has num_agents={n}, this normalizer has {self.num_agents}"
            )
        if "moments" not in state_dict:
            raise KeyError("ValueNormalizer.load_state_dict: state_dict has no 'moments' entry")
        self.eps = float(state_dict.get("eps", self.eps))
        self.moments.load_state_dict(state_dict["moments"])

    def to(self, device: torch.device | str) -> ValueNormalizer:
        self.moments.to(device)
        return self

    def __repr__(self) -> str:
        mean, std = self.stats()
        return (
            f"ValueNormalizer(num_agents={self.num_agents}, count={self.count.tolist()}, "
            f"mean={[round(v, 4) for v in mean.tolist()]}, std={[round(v, 4) for v in std.tolist()]})"
        )


# ---- advantages ---------------------------------------------------------------------------------------------
def per_agent_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    agent_index: torch.Tensor | None,
    gamma: float,
    lam: float,
    bootstrap_value: torch.Tensor | float | None = None,
    value_normalizer: ValueNormalizer | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE along each agent's own trajectory: ``(advantages, returns)``, float32 ``[B, T]``, 0 at padding.

    Each row is one agent's trajectory, so the recursion never mixes agents (MAPPO computes GAE per agent,
    with each agent's own value estimates). Runs on the fused :func:`palestra.kernels.gae` kernel, which skips
    padding wherever it sits.

    Args:
        rewards, values: ``[B, T]``. ``values`` are critic outputs: in return units, or normalised when
            ``value_normalizer`` is given (then they, and ``bootstrap_value``, are de-normalised per agent first,
            and the returned ``returns`` are in return units, ready for ``value_normalizer.update``).
        mask: ``[B, T]`` valid steps (None: all valid).
        agent_index: ``[B]`` agent of each row; needed with ``value_normalizer``, else only checked.
        gamma, lam: discount and GAE lambda in [0, 1].
        bootstrap_value: value after each row's last valid step (``[B]`` or a number); None = terminal (0).
    """
    fn = "per_agent_gae"
    _tensor(fn, "rewards", rewards, _FLOATS)
    if rewards.dim() != 2:
        raise ValueError(f"{fn}: rewards has shape {_shape(rewards)}, expected [B, T] (one row per agent trajectory)")
    _tensor(fn, "values", values, _FLOATS)
    _same_shape(fn, "values", values, "rewards", rewards)
    m = _mask(fn, mask, "rewards", rewards)
    B = rewards.shape[0]
    num_agents = value_normalizer.num_agents if value_normalizer is not None else None
    ids = None
    if agent_index is not None:
        ids = _agent_ids(fn, agent_index, "rewards", rewards, num_agents)
        if agent_index.dim() == 2 and not bool((ids == ids[:, :1]).all()):
            raise ValueError(
                f"{fn}: agent_index {_shape(agent_index)} changes agent within a row; a row is one agent's trajectory"
            )
    elif value_normalizer is not None:
        raise ValueError(
            f"{fn}: agent_index is required with value_normalizer (one id per row of rewards {_shape(rewards)})"
        )
    v = values.detach()
    boot = bootstrap_value
    if isinstance(boot, torch.Tensor):
        _tensor(fn, "bootstrap_value", boot, _FLOATS)
        if boot.shape != (B,):
            raise ValueError(
                f"{fn}: bootstrap_value has shape {_shape(boot)}, expected [{B}] (one value per row of rewards)"
            )
        boot = boot.detach()
    if value_normalizer is not None:
        assert ids is not None  # agent_index is required with a value_normalizer: checked above
        v = value_normalizer.denormalize(v, ids)
        if boot is not None:
            b = boot if isinstance(boot, torch.Tensor) else torch.full((B,), float(boot), device=rewards.device)
            boot = value_normalizer.denormalize(b, ids[:, 0])
    return gae(_f32(rewards.detach()), _f32(v), m, gamma, lam, bootstrap_value=boot)


def normalize_advantages_per_agent(
    adv: torch.Tensor,
    mask: torch.Tensor | None,
    agent_index: torch.Tensor,
    num_agents: int | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten advantages within each agent: ``(A - mean_a) / sqrt(var_a + eps)`` over agent ``a``'s valid positions.

    Why per agent: with one batch-wide whitening an agent whose advantages are large (a noisy role, a bigger
    reward scale) sets the scale and the others' signals shrink towards 0. Mean and **unbiased** variance per
    agent (as :func:`palestra.kernels.advantages.masked_whiten` does over the whole batch); padding stays 0; an
    agent with fewer than two valid positions gets 0 advantages (nothing to compare against). Float32 output.

    ``adv`` is ``[B, T]`` (or ``[N]``); ``agent_index`` is ``[B]`` or the shape of ``adv``.
    """
    fn = "normalize_advantages_per_agent"
    _tensor(fn, "adv", adv, _FLOATS)
    m = _mask(fn, mask, "adv", adv)
    ids = _agent_ids(fn, agent_index, "adv", adv, num_agents)
    S = num_agents if num_agents is not None else (int(ids.max()) + 1 if ids.numel() else 1)
    a = adv.detach().to(torch.float64)
    w = m.to(torch.float64)
    flat_ids = ids.reshape(-1)
    n = torch.zeros(S, dtype=torch.float64, device=adv.device).index_add_(0, flat_ids, w.reshape(-1))
    total = torch.zeros(S, dtype=torch.float64, device=adv.device).index_add_(0, flat_ids, (a * w).reshape(-1))
    mean = total / n.clamp(min=1.0)
    centred = (a - mean[ids]) * w
    ss = torch.zeros(S, dtype=torch.float64, device=adv.device).index_add_(0, flat_ids, (centred * centred).reshape(-1))
    var = ss / (n - 1.0).clamp(min=1.0)
    return (centred * torch.rsqrt(var[ids] + eps)).to(torch.float32)


# ---- gradients ----------------------------------------------------------------------------------------------
AgentKey = TypeVar("AgentKey")  # whatever names a group (an agent id, "shared", "critic"); the norms use the same


def per_agent_clip_grad_norm(
    param_groups: Mapping[AgentKey, Iterable[torch.nn.Parameter]],
    max_norm: float,
    norm_type: float = 2.0,
) -> dict[AgentKey, float]:
    """Clip each agent's gradients to ``max_norm`` separately; returns each agent's pre-clip total norm.

    Why: with one global clip, the agent with the largest gradients sets the scale factor for everyone, so the
    others' updates shrink with it (or a quiet agent's update is invisible in the global norm). Clipping per
    agent keeps each agent's step bounded on its own. A parameter may belong to one group only (shared layers
    belong in a group of their own, e.g. ``"shared"``): it would otherwise be clipped twice. Parameters
    without a gradient are skipped; a group without any gradient reports 0.0. A non-finite norm is returned
    as is (and the gradients are then non-finite too): the caller's non-finite check skips the step.
    """
    fn = "per_agent_clip_grad_norm"
    if not isinstance(param_groups, Mapping):
        raise TypeError(
            f"{fn}: param_groups must be a dict agent -> list of parameters, got {type(param_groups).__name__}"
        )
    if not max_norm > 0:
        raise ValueError(f"{fn}: max_norm must be > 0, got {max_norm}")
    owner: dict[int, AgentKey] = {}
    norms: dict[AgentKey, float] = {}
    for agent, params in param_groups.items():
        params = list(params)
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{fn}: param_groups[{agent!r}] holds a {type(p).__name__}, expected Parameters")
            if id(p) in owner:
                raise ValueError(
                    f"{fn}: a parameter of shape {_shape(p)} is in both param_groups[{owner[id(p)]!r}] and "
                    f"param_groups[{agent!r}]; put shared parameters in one group"
                )
            owner[id(p)] = agent
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            norms[agent] = 0.0
            continue
        total = torch.nn.utils.clip_grad_norm_(with_grad, float(max_norm), norm_type=norm_type, foreach=None)
        norms[agent] = float(total)
    return norms
