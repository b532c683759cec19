"""Palestra's fused ops: log-prob gather with entropy (alone, or fused with the output head), advantage
estimators, running reward normalisation.

Each op has a plain-torch reference, a C++ CPU kernel, a CUDA kernel and a Triton kernel; the input's
device picks one (see :mod:`palestra.kernels.dispatch`). Native back ends are built lazily, on first use.
"""

if __name__ != "palestra.kernels":
    # This folder sits at the top of the source tree, so `python -m ...` or `python -c` run from the repository
    # root puts it on sys.path as a top-level `kernels`, where it shadows Hugging Face's `kernels` package that
    # transformers (>= 5.25) imports. Fail here, naming the cause, instead of deep inside transformers.
    import os as _os

    raise ImportError(
        f"{_os.path.dirname(_os.path.abspath(__file__))} is palestra.kernels, but it was imported as the top-level "
        f"module {__name__!r}: the Palestra source tree is on sys.path (the current directory, under `python -m` "
        "or `python -c`) and hides Hugging Face's `kernels` package, which transformers needs; run `pytest` or "
        "`palestra` directly, use `python -P`, or run from another folder"
    )

from .advantages import discounted_returns, gae, group_advantages, rloo_advantages
from .build import KernelBuildError
from .dispatch import BACKENDS, forced_backend, set_backend
from .linear_logprob_entropy import linear_logprob_entropy
from .logprob_entropy import logprob_entropy
from .reward_norm import RunningMoments, normalize_rewards

__all__ = [
    "BACKENDS",
    "KernelBuildError",
    "RunningMoments",
    "discounted_returns",
    "forced_backend",
    "gae",
    "group_advantages",
    "linear_logprob_entropy",
    "logprob_entropy",
    "normalize_rewards",
    "rloo_advantages",
    "set_backend",
]
