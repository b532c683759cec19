"""Palestra: an RL gym for language models.

What a plugin author needs, importable from ``palestra`` alone::

    from palestra import hookimpl, option, Observation, StepResult, RewardOutput, Algorithm

The contract lives at the top of the package: :mod:`palestra.hookspecs` (the hooks a plugin implements),
:mod:`palestra.types` (what components exchange), :mod:`palestra.context` (what the trainer hands each
component), :mod:`palestra.registry` and :mod:`palestra.plugin_manager`. The machinery is in sub-packages:
``config``, ``engine`` (trainer, rollout, learner, checkpoints, watchdog), ``scale`` (distributed, precision,
micro-batching, offload), ``rl`` (the loss and advantage math), ``multiagent``, ``models`` and ``cli``.

Names that need torch (the learner base, the causal-LM policy base) load on first use, so that importing
``palestra`` (and ``palestra plugins`` / ``palestra config show``) stays light.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# OpenMP threads that spin while they wait for work make a small model tens of times slower when another job shares
# the cores (each parallel region waits for a thread the kernel descheduled). Passive waiting costs a quiet machine
# little; it must be set before torch loads its OpenMP runtime, which reads it once. The user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from palestra.hookspecs import PLUGIN_API, hookimpl

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "option": "palestra.config",
    "check_options": "palestra.config",
    "ConfigError": "palestra.config",
    "OptionError": "palestra.config",
    "AgentId": "palestra.types",
    "DEFAULT_AGENT": "palestra.types",
    "Message": "palestra.types",
    "Observation": "palestra.types",
    "StepResult": "palestra.types",
    "Turn": "palestra.types",
    "Episode": "palestra.types",
    "RewardOutput": "palestra.types",
    "Experience": "palestra.types",
    "Generation": "palestra.types",
    "SamplingParams": "palestra.types",
    "Environment": "palestra.types",
    "Reward": "palestra.types",
    "Policy": "palestra.types",
    "Generator": "palestra.types",
    "PolicyOptimizer": "palestra.types",
    "Logger": "palestra.types",
    "Stateful": "palestra.types",
    "HeldOutScoring": "palestra.types",
    "GradientCheckpointing": "palestra.types",
    "AdapterPolicy": "palestra.types",
    "HeldOutSplit": "palestra.types",
    "Exportable": "palestra.types",
    "FileLogger": "palestra.types",
    "TrainContext": "palestra.context",
    "MissingDependency": "palestra.registry",
    "RunState": "palestra.run_state",
    "Algorithm": "palestra.engine.algorithm",
    "AlgorithmOptions": "palestra.engine.algorithm",
    "ReplayOptions": "palestra.engine.algorithm",
    "ParamGroup": "palestra.engine.algorithm",
    "Learner": "palestra.engine.learner",
    "CausalLMPolicy": "palestra.models.policy",
    "TokenScores": "palestra.models.policy",
}

__all__ = ["PLUGIN_API", "__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'palestra' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# palestra.kernels is the kernels/ folder, which has no __init__.py (so that it does not hide Hugging Face's
# `kernels` from the repository root): this tells the import system where its package body is. Nothing above
# imports palestra.kernels.
from palestra import _kernels_home  # noqa: E402

_kernels_home.install()
