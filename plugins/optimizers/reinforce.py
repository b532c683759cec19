"""REINFORCE (Williams, 1992) with running reward normalisation, an optional baseline and experience replay.

Advantages (one per row): the reward normalised by running statistics (``palestra.kernels.RunningMoments``
+ ``normalize_rewards``: ``(r - mean) / std`` with the moments of every reward seen so far, clipped to
``+-norm_clip``), kept **per agent** (each ``batch.agent_ids`` value is its own segment, so a retriever's
rewards never shift a responder's scale). Subtracting the running mean already acts as a baseline;
``baseline="batch"`` / ``"group"`` additionally subtracts the batch's / the prompt group's mean.

Loss per token: ``-w * A * log pi(token)`` with ``w = min(pi / mu, replay_is_clip)`` detached, where
``mu`` is the behaviour policy that sampled the token (``batch.behaviour_logprobs``). This is the
truncated importance weight of V-trace / ACER (Espeholt et al. 2018; Wang et al. 2017): for fresh rows
in the first pass ``w`` is ~1 (ratio 1 up to numerics), for replayed rows and later passes it corrects
for staleness, with the truncation bounding the variance.

Replay: with ``replay_capacity > 0`` the last ``replay_capacity`` batches (their rows and the
advantages they had) are kept, and every update adds ``replay_rows`` rows drawn uniformly without
replacement from them (by the algorithm's generator, so runs repeat and checkpoints resume exactly).
A batch joins the buffer after its own update (the learner's :class:`palestra.rl.replay.ReplayBuffer`, which the
GRPO family shares). ``policy/clip_frac`` reports the fraction of tokens whose weight was truncated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from palestra import Algorithm, Experience, ReplayOptions, hookimpl, option

if TYPE_CHECKING:
    import torch

    from palestra.kernels import RunningMoments


@dataclass
class ReinforceOptions(ReplayOptions):
    normalize: bool = True  # running per-agent reward normalisation (else the raw rewards)
    norm_clip: float | None = option(5.0, gt=0)  # normalised rewards clipped to +-norm_clip; None: no clipping
    baseline: Literal["none", "batch", "group"] = "none"  # also subtract the batch's / the group's mean
    replay_is_clip: float = option(1.0, gt=0)  # truncation c of the importance weight min(pi/mu, c)


class Reinforce(Algorithm):
    """REINFORCE with per-agent running normalisation, optional baseline and truncated-IS experience replay."""

    name = "reinforce"
    Options = ReinforceOptions
    options: ReinforceOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.agents: dict[str, int] = {}  # agent id -> segment of the running statistics
        self.moments: RunningMoments | None = None

    # ---- advantages -------------------------------------------------------------------------------------
    def segment_ids(self, agent_ids: list[str], device: Any) -> torch.Tensor:
        """Each row's agent segment; a new agent gets a fresh segment (the statistics grow by one)."""
        import torch

        from palestra.kernels import RunningMoments

        for a in agent_ids:
            if a not in self.agents:
                self.agents[a] = len(self.agents)
        n = len(self.agents)
        if self.moments is None or self.moments.num_segments < n:
            grown = RunningMoments(num_segments=n, device=device)
            if self.moments is not None:  # carry the old segments' statistics over; new ones start empty
                old, k = self.moments.state_dict(), self.moments.num_segments
                state = grown.state_dict()
                state["count"][:k], state["mean"][:k], state["m2"][:k] = old["count"], old["mean"], old["m2"]
                state["synced"][:, :k] = old["synced"]
                grown.load_state_dict(state)
            self.moments = grown
        if self.moments.device != torch.device(device):
            self.moments.to(device)
        return torch.tensor([self.agents[a] for a in agent_ids], dtype=torch.int64, device=device)

    def advantages(self, batch: Experience) -> Experience:
        from palestra.kernels import normalize_rewards

        o = self.options
        r = batch.rewards.float()
        dist = self.context.distributed if self.context.is_distributed else None
        if o.normalize and dist is not None:
            # Every rank registers every rank's agents in one order, folds its rows into the statistics, merges
            # the ranks' new moments (exact Chan merge, identical on every rank), then normalises with them:
            # what one process would do with the global batch.
            for part in dist.all_gather_object(list(dict.fromkeys(batch.agent_ids))):
                self.segment_ids(part, r.device)
            seg = self.segment_ids(batch.agent_ids, r.device)
            assert self.moments is not None
            self.moments.update(r, seg)
            dist.merge_moments(self.moments)
            r = normalize_rewards(r, self.moments, segment_ids=seg, clip=o.norm_clip, update=False)
        elif o.normalize:
            seg = self.segment_ids(batch.agent_ids, r.device)
            assert self.moments is not None
            r = normalize_rewards(r, self.moments, segment_ids=seg, clip=o.norm_clip)
        if o.baseline == "batch":
            r = r - r.mean()
        elif o.baseline == "group":
            from palestra.rl import group_size_of

            g = group_size_of(batch.group_ids, self.name)
            r = (r.view(-1, g) - r.view(-1, g).mean(-1, keepdim=True)).reshape(-1)
        batch.advantages = r
        return batch

    # ---- loss ------------------------------------------------------------------------------------------------
    def loss(self, batch: Experience, scores: Any):
        o = self.options
        mask = batch.completion_mask
        logp = scores.logprobs
        log_ratio = (logp.detach() - batch.behaviour_logprobs.to(logp.dtype)).masked_fill(~mask, 0.0)
        ratio = log_ratio.exp()
        weight = ratio.clamp(max=o.replay_is_clip)
        per_token = -weight * self.token_advantages(batch) * logp
        metrics = {
            # truncated beyond float noise (a fresh row's ratio is 1 only up to rounding)
            "policy/clip_frac": self.metric_mean((ratio > o.replay_is_clip * (1 + 1e-5)).to(logp.dtype), mask),
            "policy/ratio_mean": self.metric_mean(ratio, mask),
        }
        per_token = self.entropy_and_kl(per_token, batch, scores, metrics)
        return self.aggregate(per_token, mask), metrics

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"agents": list(self.agents), "moments": self.moments.state_dict() if self.moments is not None else None}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        from palestra.kernels import RunningMoments

        if set(state) != {"agents", "moments"}:
            raise KeyError(
                f"{self.name}.load_state_dict: extra state has keys {sorted(state)}, expected agents, moments"
            )
        self.agents = {a: i for i, a in enumerate(state["agents"])}
        self.moments = None
        if state["moments"] is not None:
            self.moments = RunningMoments(num_segments=len(self.agents), device=state["moments"]["count"].device)
            self.moments.load_state_dict(state["moments"])


@hookimpl
def register_optimizers(register: Any) -> None:
    register(
        "reinforce",
        Reinforce,
        options=ReinforceOptions,
        description=(
            "REINFORCE: per-agent running reward normalisation, optional baseline, truncated-IS experience replay"
        ),
    )
