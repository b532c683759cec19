"""Palestra's fused ops: log-prob gather with entropy (alone, or fused with the output head), advantage
estimators, running reward normalisation.

Each op has a plain-torch reference, a C++ CPU kernel, a CUDA kernel and a Triton kernel; the input's
device picks one (see :mod:`palestra.kernels.dispatch`). Native back ends are built lazily, on first use.

This file is the package's body, what an ``__init__.py`` would hold. The folder has none on purpose: it sits at
the top of the source tree, and Python run from the repository root (``python -m pytest``, ``python -c``) puts
the root on sys.path, where a regular package named ``kernels`` would hide Hugging Face's ``kernels``, which
transformers imports. Without ``__init__.py`` the folder is only a namespace portion there, and the installed
package wins. :mod:`palestra._kernels_home` loads this file as ``palestra.kernels``.
"""

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
