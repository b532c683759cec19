"""The standard multi-agent check: MAPPO (and IPPO) on PettingZoo/MPE2 ``simple_spread_v3`` against a random policy.

Issue 6, point 6: the generic MAPPO math of :mod:`palestra.plugins.optimizers.mappo.per_agent` (per-agent GAE,
per-agent value normalisation, PPO clip for actor and critic, per-agent advantage normalisation, per-group gradient
clipping) must improve clearly over a random policy on a standard cooperative task within a CPU budget. This file holds

* :class:`ParallelEnvAdapter`, a thin adapter from any PettingZoo *parallel* env to batched tensors
  (``obs [n_envs, n_agents, obs_dim]``, global ``state [n_envs, state_dim]``, ``rewards``/``dones
  [n_envs, n_agents]``), vectorised by holding several env instances;
* :class:`MAPPOTrainer`: small MLP actors (one shared-parameter actor fed the agent's one-hot id) and a critic
  that sees the joint state (MAPPO) or only the agent's own observation (IPPO, ``critic="local"``);
* a CLI that runs random, MAPPO and IPPO in one process and writes a PNG curve and a JSON of the numbers::

    python bench/mpe_simple_spread.py --steps 150000 --out bench/results   # ~6 min on 1 thread (2 runs)

Reported return: the episode return of one agent (sum of its 25 rewards), averaged over the agents. The curve
shows training episodes (sampled actions); the headline figures are evaluation episodes after training, on
start configurations seeded apart from training and shared with the random policy (a paired comparison).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from palestra.plugins.optimizers.mappo.per_agent import (
    ValueNormalizer,
    normalize_advantages_per_agent,
    per_agent_clip_grad_norm,
    per_agent_gae,
)
from palestra.rl import clipped_surrogate, value_loss

__all__ = [
    "MAPPOConfig",
    "MAPPOTrainer",
    "ParallelEnvAdapter",
    "StepResult",
    "main",
    "make_simple_spread",
    "random_policy_return",
]

EVAL_SEED = 777_000  # evaluation episodes are seeded apart from every training run


# ---- the adapter -------------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """One vectorised step. Agent axis in ``adapter.agents`` order; an agent that is gone reads 0 / done."""

    obs: torch.Tensor  # [E, A, obs_dim] float32: observation after the step (0 for an agent that is gone)
    state: torch.Tensor  # [E, state_dim] float32: global state after the step
    rewards: torch.Tensor  # [E, A] float32
    terminated: torch.Tensor  # [E, A] bool: the agent's episode ended for good (no bootstrap)
    truncated: torch.Tensor  # [E, A] bool: cut by a time limit (bootstrap from the value of ``obs``)
    active: torch.Tensor  # [E, A] bool: the agent acted in this step (its reward and transition count)

    @property
    def dones(self) -> torch.Tensor:
        return self.terminated | self.truncated


class ParallelEnvAdapter:
    """Batch ``n_envs`` PettingZoo parallel envs into tensors, with a fixed agent order (``possible_agents``).

    No auto-reset: an env whose agents are all done stays done (its rows read 0 / done) until :meth:`reset`,
    so a rollout of ``max_cycles`` steps is one episode per env, rows line up with episodes and per-agent GAE
    needs no mid-row resets. ``state="env"`` uses ``env.state()`` as the global state, ``"concat"`` (default)
    the concatenated observations in agent order, ``"auto"`` the former when the env implements it. For MPE the
    two are equal, and ``"concat"`` saves ``state()`` recomputing every observation (a third of the step time).
    Discrete action spaces only (every agent the same size).
    """

    def __init__(self, make_env: Callable[[], object], n_envs: int, seed: int = 0, state: str = "concat"):
        if n_envs < 1:
            raise ValueError(f"ParallelEnvAdapter: n_envs must be >= 1, got {n_envs}")
        if state not in ("auto", "env", "concat"):
            raise ValueError(f"ParallelEnvAdapter: state must be 'auto', 'env' or 'concat', got {state!r}")
        self.make_env = make_env
        self.envs = [make_env() for _ in range(n_envs)]
        env = self.envs[0]
        self.agents: list[str] = list(env.possible_agents)
        self.n_envs, self.n_agents = n_envs, len(self.agents)
        spaces = [env.action_space(a) for a in self.agents]
        if not all(hasattr(s, "n") for s in spaces) or len({int(s.n) for s in spaces}) != 1:
            raise ValueError(f"ParallelEnvAdapter: needs one Discrete action space size for all agents, got {spaces}")
        self.n_actions = int(spaces[0].n)
        obs_shapes = {tuple(env.observation_space(a).shape) for a in self.agents}
        if len(obs_shapes) != 1 or len(next(iter(obs_shapes))) != 1:
            raise ValueError(f"ParallelEnvAdapter: needs one flat observation shape for all agents, got {obs_shapes}")
        self.obs_dim = next(iter(obs_shapes))[0]
        self.seed = seed
        self._seeded = False
        self.state_dim = self.obs_dim * self.n_agents
        if state != "concat":  # probe env.state() (reset() re-seeds env 0 anyway on the first call)
            env.reset(seed=seed)
            try:
                self.state_dim = int(np.asarray(env.state()).size)
                state = "env"
            except (NotImplementedError, AttributeError):
                if state == "env":
                    raise ValueError(
                        f"ParallelEnvAdapter: state='env' but {type(env).__name__} has no state()"
                    ) from None
                state = "concat"
        self.state_mode = state
        self._alive = np.zeros((n_envs, self.n_agents), dtype=bool)
        self._obs = np.zeros((n_envs, self.n_agents, self.obs_dim), dtype=np.float32)
        self._state = np.zeros((n_envs, self.state_dim), dtype=np.float32)

    def _write(self, i: int, obs: dict) -> None:
        self._obs[i] = 0.0
        for j, a in enumerate(self.agents):
            if a in obs:
                self._obs[i, j] = obs[a]
        env = self.envs[i]
        if self.state_mode == "env" and env.agents:
            self._state[i] = np.asarray(env.state(), dtype=np.float32).reshape(-1)
        else:
            self._state[i] = self._obs[i].reshape(-1)

    def reset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Reset every env; returns ``(obs [E, A, obs_dim], state [E, state_dim])``. The first reset seeds env ``i``
        with ``seed + i``; later resets continue each env's own random stream."""
        for i, env in enumerate(self.envs):
            obs, _ = env.reset(seed=self.seed + i) if not self._seeded else env.reset()
            self._alive[i] = [a in env.agents for a in self.agents]
            self._write(i, obs)
        self._seeded = True
        return torch.from_numpy(self._obs.copy()), torch.from_numpy(self._state.copy())

    def step(self, actions: torch.Tensor | np.ndarray) -> StepResult:
        """Step every env that is still running with ``actions [E, A]`` (ints; entries of gone agents are ignored)."""
        acts = np.asarray(actions.cpu() if isinstance(actions, torch.Tensor) else actions)
        if acts.shape != (self.n_envs, self.n_agents):
            raise ValueError(
                f"ParallelEnvAdapter.step: actions has shape {list(acts.shape)}, "
                f"expected [{self.n_envs}, {self.n_agents}]"
            )
        E, A = self.n_envs, self.n_agents
        rewards = np.zeros((E, A), dtype=np.float32)
        term = np.ones((E, A), dtype=bool)
        trunc = np.zeros((E, A), dtype=bool)
        active = self._alive.copy()
        for i, env in enumerate(self.envs):
            if not env.agents:
                self._obs[i] = 0.0
                continue
            obs, rew, te, tr, _ = env.step({a: int(acts[i, j]) for j, a in enumerate(self.agents) if a in env.agents})
            for j, a in enumerate(self.agents):
                if a in rew:
                    rewards[i, j] = rew[a]
                    term[i, j], trunc[i, j] = bool(te[a]), bool(tr[a]) and not bool(te[a])
            self._alive[i] = [a in env.agents for a in self.agents]
            self._write(i, obs)
        return StepResult(
            obs=torch.from_numpy(self._obs.copy()),
            state=torch.from_numpy(self._state.copy()),
            rewards=torch.from_numpy(rewards),
            terminated=torch.from_numpy(term & active),
            truncated=torch.from_numpy(trunc & active),
            active=torch.from_numpy(active),
        )

    @property
    def all_done(self) -> bool:
        return not self._alive.any()

    def close(self) -> None:
        for env in self.envs:
            env.close()


def make_simple_spread(max_cycles: int = 25, n_agents: int = 3) -> Callable[[], object]:
    def make():
        from mpe2 import simple_spread_v3

        return simple_spread_v3.parallel_env(N=n_agents, max_cycles=max_cycles, continuous_actions=False)

    return make


# ---- networks and trainer ------------------------------------------------------------------------------------
def mlp(inp: int, out: int, hidden: int, out_gain: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(inp, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))
    for layer in net:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, gain=out_gain if layer is net[-1] else math.sqrt(2))
            nn.init.zeros_(layer.bias)
    return net


@dataclass
class MAPPOConfig:
    critic: str = "central"  # "central": critic on the joint state (MAPPO); "local": on the agent's own obs (IPPO)
    n_envs: int = 8  # episodes per update
    hidden: int = 64
    lr: float = 2e-3
    critic_lr: float = 2e-3
    epochs: int = 10
    minibatches: int = 2
    gamma: float = 0.95  # 25-step episodes with dense rewards: a short horizon learns faster
    lam: float = 0.95
    clip: float = 0.2
    value_clip: float | None = 0.2
    huber_delta: float | None = 10.0
    entropy_coef: float = 0.01
    max_grad_norm: float = 10.0
    seed: int = 0


class MAPPOTrainer:
    """Shared-parameter actor (own obs + agent one-hot) and a critic (joint state or own obs, + one-hot).

    One update = ``n_envs`` full episodes; rows of the update batch are one agent's episode each
    (``[n_envs * n_agents, T]``), so GAE runs per agent along its own trajectory with a truncation bootstrap
    from the value of the final observation. The critic regresses per-agent normalised returns
    (:class:`palestra.plugins.optimizers.mappo.per_agent.ValueNormalizer`), advantages are normalised per agent, and
    actor and critic are clipped as two gradient groups (their separate optimisers, as in MAPPO).
    """

    def __init__(self, adapter: ParallelEnvAdapter, config: MAPPOConfig):
        if config.critic not in ("central", "local"):
            raise ValueError(f"MAPPOConfig.critic must be 'central' or 'local', got {config.critic!r}")
        self.env, self.cfg = adapter, config
        torch.manual_seed(config.seed)
        A = adapter.n_agents
        self.eye = torch.eye(A)
        self.actor = mlp(adapter.obs_dim + A, adapter.n_actions, config.hidden, out_gain=0.01)
        critic_in = (adapter.state_dim if config.critic == "central" else adapter.obs_dim) + A
        self.critic = mlp(critic_in, 1, config.hidden, out_gain=1.0)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=config.lr, eps=1e-5)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=config.critic_lr, eps=1e-5)
        self.vn = ValueNormalizer(A)
        self.gen = torch.Generator().manual_seed(config.seed)
        self.env_steps = 0
        self.curve: list[tuple[int, float]] = []  # (env steps so far, mean agent episode return of the update)

    def _actor_in(self, obs: torch.Tensor) -> torch.Tensor:  # [..., A, obs_dim] -> [..., A, obs_dim + A]
        return torch.cat([obs, self.eye.expand(*obs.shape[:-1], -1)], dim=-1)

    def _critic_in(self, obs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        A = self.env.n_agents
        x = state.unsqueeze(-2).expand(*state.shape[:-1], A, -1) if self.cfg.critic == "central" else obs
        return torch.cat([x, self.eye.expand(*x.shape[:-1], -1)], dim=-1)

    @torch.no_grad()
    def collect(self) -> dict[str, torch.Tensor]:
        """Run one episode in every env; tensors ``[E, A, T, ...]``."""
        env = self.env
        obs, state = env.reset()
        keys = ("obs", "state", "actions", "logp", "values", "rewards", "mask")
        buf: dict[str, list] = {k: [] for k in keys}
        while not env.all_done:
            logits = self.actor(self._actor_in(obs))
            actions = torch.multinomial(torch.softmax(logits, -1).reshape(-1, env.n_actions), 1, generator=self.gen)
            actions = actions.reshape(env.n_envs, env.n_agents)
            logp = torch.log_softmax(logits, -1).gather(-1, actions[..., None])[..., 0]
            values = self.critic(self._critic_in(obs, state))[..., 0]
            res = env.step(actions)
            for k, v in zip(keys, (obs, state, actions, logp, values, res.rewards, res.active)):
                buf[k].append(v)
            obs, state, last = res.obs, res.state, res
        self.env_steps += int(torch.stack(buf["mask"]).any(-1).sum())
        out = {k: torch.stack(v, dim=2) for k, v in buf.items() if k != "state"}
        out["state"] = torch.stack(buf["state"], dim=1)  # [E, T, state_dim]
        # Bootstrap: value of the final observation for a time-limit cut, 0 for a true termination.
        boot = self.critic(self._critic_in(obs, state))[..., 0]
        out["bootstrap"] = torch.where(last.truncated, boot, torch.zeros_like(boot))
        return out

    def update(self, data: dict[str, torch.Tensor]) -> dict[str, float]:
        cfg = self.cfg
        E, A, T = data["rewards"].shape
        B = E * A
        agent = torch.arange(A).repeat(E)  # row b = (env b // A, agent b % A)
        mask = data["mask"].reshape(B, T)
        old_values = data["values"].reshape(B, T)
        adv, returns = per_agent_gae(
            data["rewards"].reshape(B, T),
            old_values,
            mask,
            agent,
            cfg.gamma,
            cfg.lam,
            bootstrap_value=data["bootstrap"].reshape(B),
            value_normalizer=self.vn,
        )
        self.vn.update(returns, agent, mask)
        target = self.vn.normalize(returns, agent)
        adv = normalize_advantages_per_agent(adv, mask, agent, num_agents=A)
        obs = data["obs"].reshape(B, T, -1)
        state = data["state"][:, None].expand(E, A, T, -1).reshape(B, T, -1)
        onehot = self.eye[agent][:, None].expand(B, T, A)
        actor_x = torch.cat([obs, onehot], -1)
        critic_x = torch.cat([state if cfg.critic == "central" else obs, onehot], -1)
        actions, old_logp = data["actions"].reshape(B, T), data["logp"].reshape(B, T)
        stats: dict[str, list[float]] = {}
        for _ in range(cfg.epochs):
            perm = torch.randperm(B, generator=self.gen)
            for idx in perm.chunk(cfg.minibatches):
                logits = self.actor(actor_x[idx])
                logp_all = torch.log_softmax(logits, -1)
                logp = logp_all.gather(-1, actions[idx][..., None])[..., 0]
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                m = mask[idx]
                n = m.sum().clamp(min=1)
                pg, pm = clipped_surrogate(logp, old_logp[idx], adv[idx], m, clip_low=cfg.clip)
                ent = (entropy * m).sum() / n
                actor_loss = pg.sum() / n - cfg.entropy_coef * ent
                values = self.critic(critic_x[idx])[..., 0]
                vl, vm = value_loss(
                    values, old_values[idx], target[idx], m, clip=cfg.value_clip, huber_delta=cfg.huber_delta
                )
                critic_loss = vl.sum() / n
                self.actor_opt.zero_grad(set_to_none=True)
                self.critic_opt.zero_grad(set_to_none=True)
                (actor_loss + critic_loss).backward()
                norms = per_agent_clip_grad_norm(
                    {"actor": self.actor.parameters(), "critic": self.critic.parameters()}, cfg.max_grad_norm
                )
                self.actor_opt.step()
                self.critic_opt.step()
                for k, v in {
                    **pm,
                    **vm,
                    "entropy": ent.detach(),
                    "grad_norm/actor": norms["actor"],
                    "grad_norm/critic": norms["critic"],
                }.items():
                    stats.setdefault(k, []).append(float(v))
        return {k: float(np.mean(v)) for k, v in stats.items()}

    @torch.no_grad()
    def act(self, obs: torch.Tensor, greedy: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
        """Actions ``[E, A]`` of the current actor for ``obs [E, A, obs_dim]``: the most likely, or sampled."""
        logits = self.actor(self._actor_in(obs))
        if greedy:
            return logits.argmax(-1)
        flat = torch.multinomial(torch.softmax(logits, -1).reshape(-1, logits.shape[-1]), 1, generator=generator)
        return flat.reshape(logits.shape[:-1])

    def evaluate(self, episodes: int, greedy: bool = True, n_envs: int = 16, seed: int = EVAL_SEED) -> list[float]:
        """Agent episode returns of the current actor over ``episodes`` evaluation episodes (see :func:`evaluate`)."""
        g = torch.Generator().manual_seed(seed)
        return evaluate(self.env.make_env, lambda obs: self.act(obs, greedy, g), episodes, n_envs, seed)

    def train(self, env_steps: int, log: Callable[[str], None] | None = None) -> list[tuple[int, float]]:
        while self.env_steps < env_steps:
            data = self.collect()
            ret = float(data["rewards"].sum(-1).mean())  # mean over envs and agents of the episode return
            metrics = self.update(data)
            self.curve.append((self.env_steps, ret))
            if log is not None and len(self.curve) % 20 == 0:
                log(
                    f"{self.cfg.critic:>7} steps {self.env_steps:>7} return {ret:8.2f} "
                    f"entropy {metrics['entropy']:.3f} kl {metrics['approx_kl']:.4f} clip {metrics['clip_frac']:.3f}"
                )
        return self.curve


def evaluate(
    make_env, act: Callable[[torch.Tensor], torch.Tensor], episodes: int, n_envs: int = 16, seed: int = EVAL_SEED
) -> list[float]:
    """Agent episode returns (mean over agents) of ``act(obs [E, A, obs_dim]) -> actions [E, A]`` over ``episodes``.

    Env ``i`` is seeded ``seed + i`` and its episodes follow its own stream, so two policies evaluated with the
    same ``(episodes, n_envs, seed)`` face the same start configurations: a paired comparison, whose difference
    is free of the (large) variance between start configurations.
    """
    env = ParallelEnvAdapter(make_env, n_envs, seed=seed)
    rets: list[float] = []
    while len(rets) < episodes:
        obs, _ = env.reset()
        total = torch.zeros(env.n_envs, env.n_agents)
        while not env.all_done:
            res = env.step(act(obs))
            total += res.rewards
            obs = res.obs
        rets += total.mean(-1).tolist()
    env.close()
    return rets[:episodes]


def random_policy_return(make_env, episodes: int, n_envs: int = 16, seed: int = EVAL_SEED) -> list[float]:
    """Agent episode returns of the uniform random policy (paired with :meth:`MAPPOTrainer.evaluate` at equal seeds)."""
    g = torch.Generator().manual_seed(seed + 1)
    n_actions = ParallelEnvAdapter(make_env, 1).n_actions

    def act(obs):
        return torch.randint(0, n_actions, obs.shape[:2], generator=g)

    return evaluate(make_env, act, episodes, n_envs, seed)


def mean_se(x: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(x, dtype=float)
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0


def final_return(curve: Sequence[tuple[int, float]], frac: float = 0.1) -> float:
    """Mean return over the last ``frac`` of the updates (at least one): the run's end-of-training figure."""
    k = max(1, round(len(curve) * frac))
    return float(np.mean([r for _, r in curve[-k:]]))


# ---- CLI -----------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    name: str
    env_steps: int
    wall_s: float
    cpu_s: float  # process CPU time of the training: the load-independent figure on a shared machine
    final_return: float  # training episodes (sampled actions), last 10% of the updates
    eval_greedy: list = field(default_factory=list)  # per evaluation episode, paired with the random policy's
    eval_sampled: list = field(default_factory=list)
    curve: list = field(default_factory=list)
    config: dict = field(default_factory=dict)


def run(kind: str, steps: int, seed: int, eval_episodes: int = 0, log=print, **overrides) -> RunResult:
    """Train MAPPO (``kind="mappo"``) or IPPO (``"ippo"``) for ``steps`` env steps, then evaluate it."""
    cfg = MAPPOConfig(critic="central" if kind == "mappo" else "local", seed=seed, **overrides)
    adapter = ParallelEnvAdapter(make_simple_spread(), cfg.n_envs, seed=seed * 1000)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer = MAPPOTrainer(adapter, cfg)
    curve = trainer.train(steps, log=log)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    adapter.close()
    greedy = trainer.evaluate(eval_episodes, greedy=True) if eval_episodes else []
    sampled = trainer.evaluate(eval_episodes, greedy=False) if eval_episodes else []
    return RunResult(
        kind, trainer.env_steps, wall, cpu, final_return(curve), greedy, sampled, [list(p) for p in curve], asdict(cfg)
    )


def smooth(y: Sequence[float], k: int) -> np.ndarray:
    y = np.asarray(y, dtype=float)
    if k <= 1 or len(y) < k:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = (c[k:] - c[:-k]) / k
    return np.concatenate([np.cumsum(y[: k - 1]) / np.arange(1, k), out])


def plot(results: Sequence[RunResult], random_mean: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in results:
        x = [p[0] for p in r.curve]
        (line,) = ax.plot(
            x, smooth([p[1] for p in r.curve], 10), label=f"{r.name.upper()} training episodes (smoothed)"
        )
        if r.eval_greedy:
            m, se = mean_se(r.eval_greedy)
            ax.errorbar(
                [x[-1]],
                [m],
                yerr=[2 * se],
                fmt="o",
                color=line.get_color(),
                capsize=4,
                label=f"{r.name.upper()} greedy eval {m:.1f} (±2 s.e.)",
            )
    ax.axhline(random_mean, color="grey", ls="--", label=f"random policy {random_mean:.1f}")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("agent episode return (mean of 3 agents)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="MAPPO / IPPO vs a random policy on MPE2 simple_spread_v3 (N=3, 25 steps)")
    p.add_argument("--steps", type=int, default=150_000, help="environment steps per trained run")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ippo", action="store_true", help="train MAPPO only")
    p.add_argument("--eval-episodes", type=int, default=256, help="evaluation episodes (same starts for every policy)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    t0, c0 = time.perf_counter(), time.process_time()
    rand = random_policy_return(make_simple_spread(), args.eval_episodes)
    rand_mean, rand_se = mean_se(rand)
    print(f"random policy: {rand_mean:.2f} +- {rand_se:.2f} (s.e., {args.eval_episodes} episodes)")
    results = [run("mappo", args.steps, args.seed, args.eval_episodes)]
    if not args.no_ippo:
        results.append(run("ippo", args.steps, args.seed, args.eval_episodes))
    runs = {}
    for r in results:
        g_mean, g_se = mean_se(r.eval_greedy)
        s_mean, s_se = mean_se(r.eval_sampled)
        gain, gain_se = mean_se(np.asarray(r.eval_greedy) - np.asarray(rand))  # paired: same start configurations
        runs[r.name] = {
            "env_steps": r.env_steps,
            "wall_s": round(r.wall_s, 1),
            "cpu_s": round(r.cpu_s, 1),
            "final_training_return": r.final_return,
            "eval_greedy": {"mean": g_mean, "stderr": g_se},
            "eval_sampled": {"mean": s_mean, "stderr": s_se},
            "greedy_gain_over_random": {"mean": gain, "stderr": gain_se},
            "config": r.config,
            "curve": r.curve,
        }
        print(
            f"{r.name}: {r.env_steps} env steps in {r.wall_s:.0f} s wall, {r.cpu_s:.0f} s CPU; "
            f"training return {r.final_return:.2f}; eval greedy {g_mean:.2f} +- {g_se:.2f}, "
            f"sampled {s_mean:.2f} +- {s_se:.2f}; gain over random {gain:+.2f} +- {gain_se:.2f} (paired)"
        )
    summary = {
        "env": "mpe2.simple_spread_v3(N=3, max_cycles=25, continuous_actions=False, local_ratio=0.5)",
        "metric": "agent episode return (sum of one agent's rewards over the episode, mean over agents)",
        "command": "python bench/mpe_simple_spread.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed,
        "threads": args.threads,
        "random": {"mean": rand_mean, "stderr": rand_se, "episodes": args.eval_episodes},
        "runs": runs,
        "total_wall_s": round(time.perf_counter() - t0, 1),
        "total_cpu_s": round(time.process_time() - c0, 1),
    }
    (args.out / "simple_spread.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(
        results,
        rand_mean,
        args.out / "simple_spread.png",
        f"MPE2 simple_spread_v3 (N=3), seed {args.seed}, {args.threads} CPU thread(s)",
    )
    print(
        f"wrote {args.out / 'simple_spread.json'} and {args.out / 'simple_spread.png'} "
        f"in {summary['total_wall_s']:.0f} s"
    )
    return summary


if __name__ == "__main__":
    main()
