"""Old module paths, kept importable for one plugin-API version with a :class:`DeprecationWarning`.

The redesign moved the flat ``palestra.*`` modules into sub-packages (``engine``, ``scale``, ``rl``,
``models``, ``multiagent``, ``cli``). A third-party plugin written against the old paths
(``from palestra.algorithm import Algorithm``) keeps working: the import finder below answers an old name
with the module that now holds it, and says once where to import from instead. New code imports from
``palestra`` itself (see ``palestra/__init__.py``) or from the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

# old module -> the module that holds its public names now
MOVED = {
    "palestra.algorithm": "palestra.engine.learner",
    "palestra.trainer": "palestra.engine.trainer",
    "palestra.rollout": "palestra.engine.rollout",
    "palestra.checkpoint": "palestra.engine.checkpoint",
    "palestra.watchdog": "palestra.engine.watchdog",
    "palestra.rewards": "palestra.checked_reward",
    "palestra.distributed": "palestra.scale.distributed",
    "palestra.precision": "palestra.scale.precision",
    "palestra.memory": "palestra.scale.micro_batching",
    "palestra.multi_agent": "palestra.multiagent.sharing",
    "palestra.marl": "palestra.plugins.optimizers.mappo.per_agent",
    "palestra.policy": "palestra.models.policy",
    "palestra.sampling": "palestra.models.sampling",
    "palestra.plotting": "palestra.cli.dashboard",
}
# names that went to a second home when their old module was split
SPLIT = {
    "palestra.memory": {"palestra.scale.offload": ("CPUMasterWeights", "borrowed")},
    "palestra.rewards": {
        "palestra.plugins.rewards.combinators": (
            "Layer", "Layered", "LayeredOptions", "WeightedComponent", "WeightedSum", "WeightedSumOptions",
        ),
    },
    "palestra.rollout": {
        "palestra.multiagent.credit": ("credit_rewards",),
        "palestra.multiagent.generation": ("generate_by_agent", "merge_generations"),
    },
    "palestra.marl": {"palestra.rl": ("masked_mean",)},  # ppo_actor_loss / clipped_value_loss: palestra.rl's losses
    "palestra.algorithm": {
        "palestra.rl": (
            "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "group_size_of", "kl_divergence", "kl_shaped_rewards",
            "last_token_rewards", "lr_factor",
        ),
    },
}


class _MovedModule(ModuleType):
    """Stands in for an old module: every attribute comes from the module(s) that hold it now."""

    def __init__(self, old: str) -> None:
        super().__init__(old)
        self.__palestra_moved_to__ = MOVED[old]

    def __getattr__(self, name: str):  # noqa: ANN204
        for target, names in SPLIT.get(self.__name__, {}).items():
            if name in names:
                return getattr(importlib.import_module(target), name)
        return getattr(importlib.import_module(MOVED[self.__name__]), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]} (import from 'palestra' where you can); "
            "the old path goes with the next plugin API version",
            DeprecationWarning,
            stacklevel=3,
        )
        return _MovedModule(spec.name)

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
