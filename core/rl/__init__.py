"""The RL math every algorithm shares, written once and tested once against float64 formulas.

* :mod:`.losses`: the clipped surrogate (with DAPO's clip-higher), GSPO's sequence-level surrogate, CISPO's
  clipped-weight policy gradient, the (clipped, optionally Huber) value loss, loss aggregation;
* :mod:`.kl`: Schulman's k1/k2/k3 KL estimators;
* :mod:`.terms`: the entropy bonus and KL penalty a loss adds, and rollout correction's weighted advantages;
* :mod:`.rollout_correction`: the importance weights for a sampler that is not the learner, and the gap metrics;
* :mod:`.returns`: sequence rewards on the last token, KL-shaped token rewards, group structure;
* :mod:`.stats`: masked means (how metrics are reported) and explained variance;
* :mod:`.schedules`: learning-rate schedules;
* :mod:`.checks`: the one-line tensor errors the functions above raise;
* :mod:`.replay`: the experience-replay buffer (REINFORCE and the GRPO family);
* :mod:`.names`: the choices options name (loss aggregations, KL estimators), importable without torch.

The advantage estimators themselves (GAE, group and leave-one-out baselines, running reward normalisation)
are kernels: :mod:`palestra.kernels`.
"""

from __future__ import annotations

import importlib
from typing import Any

from palestra.rl.names import KL_ESTIMATORS, LOSS_AGGREGATIONS, KLEstimator, LossAgg

# the math needs torch: imported on first use, so that option dataclasses can use the names above cheaply
_LAZY = {
    "kl_divergence": "palestra.rl.kl",
    "aggregate": "palestra.rl.losses",
    "cispo_surrogate": "palestra.rl.losses",
    "clipped_surrogate": "palestra.rl.losses",
    "gspo_surrogate": "palestra.rl.losses",
    "value_loss": "palestra.rl.losses",
    "group_size_of": "palestra.rl.returns",
    "kl_shaped_rewards": "palestra.rl.returns",
    "last_token_rewards": "palestra.rl.returns",
    "LR_SCHEDULES": "palestra.rl.schedules",
    "lr_factor": "palestra.rl.schedules",
    "explained_variance": "palestra.rl.stats",
    "group_tie_stats": "palestra.rl.stats",
    "masked_mean": "palestra.rl.stats",
    "ReplayBuffer": "palestra.rl.replay",
    "RolloutCorrectionOptions": "palestra.rl.rollout_correction",
    "corrected_advantages": "palestra.rl.terms",
    "entropy_and_kl": "palestra.rl.terms",
    "rollout_mismatch": "palestra.rl.rollout_correction",
}

__all__ = ["KL_ESTIMATORS", "LOSS_AGGREGATIONS", "KLEstimator", "LossAgg", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'palestra.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
