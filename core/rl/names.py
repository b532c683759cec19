"""The names options choose from (loss aggregations, KL estimators), without importing torch: option
dataclasses use them as ``Literal`` types, and loading a plugin must stay light."""

from __future__ import annotations

from typing import Literal

__all__ = ["KL_ESTIMATORS", "LOSS_AGGREGATIONS", "KLEstimator", "LossAgg"]

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")
