"""The plugin API's old module paths (before the package was split into sub-packages) keep working for one plugin
API version: the same objects, one DeprecationWarning naming the new home; and `palestra` itself re-exports what a
plugin author needs, loading the torch-backed names only on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from palestra import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_path_gives_the_new_objects_with_one_deprecation_warning(old: str) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert messages == [f"{old} moved to {_moved.MOVED[old]} (import from 'palestra' where you can); "
                        "the old path goes with the next plugin API version"]
    new = importlib.import_module(_moved.MOVED[old])
    public = [n for n, v in vars(new).items() if not n.startswith("_") and getattr(v, "__module__", None) == new.__name__]
    assert public, f"{_moved.MOVED[old]} defines no public names"
    for name in public:
        assert getattr(module, name) is getattr(new, name)
    for target, names in _moved.SPLIT.get(old, {}).items():
        for name in names:
            assert getattr(module, name) is getattr(importlib.import_module(target), name)


def test_old_style_imports_of_a_plugin_still_resolve() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from palestra.algorithm import Algorithm, group_size_of
        from palestra.memory import CPUMasterWeights, plan_micro_batches
        from palestra.rewards import CheckedReward, Layered

    import palestra
    from palestra.plugins.rewards.combinators import Layered as layered
    from palestra.rl import group_size_of as gso
    from palestra.scale.offload import CPUMasterWeights as master

    assert Algorithm is palestra.Algorithm and group_size_of is gso and CPUMasterWeights is master
    assert Layered is layered and CheckedReward.__module__ == "palestra.checked_reward"
    assert plan_micro_batches.__module__ == "palestra.scale.micro_batching"


def test_palestra_exports_the_plugin_api_without_importing_torch() -> None:
    code = ("import sys, palestra; names = [n for n in palestra.__all__ if n not in ('Algorithm', 'AlgorithmOptions', "
            "'ParamGroup', 'CausalLMPolicy', 'TokenScores', 'TrainContext')]; [getattr(palestra, n) for n in names]; "
            "print('torch' in sys.modules, palestra.PLUGIN_API)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1.0"]
    import palestra

    for name in palestra.__all__:
        assert getattr(palestra, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Algorithmm'"):
        palestra.Algorithmm  # noqa: B018
