"""What the model-backed rewards (``judge``, ``reward_model``) share: where their options sit in the config, the
hf policy's one-line loading errors renamed to them, their own device and thread count, and a bounded score cache.

Nothing here imports torch at module level: listing plugins stays fast.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from palestra.config import ConfigError

if TYPE_CHECKING:
    import torch

POLICY_WHERE = "policy.options"  # what the hf policy's loading helpers name (palestra.plugins.policies.hf.WHERE)
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
DEVICE_HINT = "auto, cpu, cuda, cuda:N or mps"


def options_path(default: str = "reward") -> str:
    """``<config path of the reward being built>.options`` (``reward.options.components[1].options`` for a term of a
    weighted sum); ``reward.options`` when the reward is built in Python, outside a config."""
    from palestra.config.building import building_path

    return f"{building_path() or default}.options"


CAUSAL_LM = "a transformers causal LM"  # what the hf policy's folder errors say the folder should hold


@contextmanager
def named_as(where: str, model: str = CAUSAL_LM) -> Iterator[None]:
    """Re-raise the hf policy's loading errors (``policy.options.path: ...``) as this reward's (``<where>.path: ...``):
    the same checks and loaders, errors naming the key the user wrote (and ``model``, what its folder should hold)."""
    try:
        yield
    except ConfigError as e:
        text = str(e)
        if POLICY_WHERE not in text:
            raise
        raise ConfigError(text.replace(POLICY_WHERE, where).replace(CAUSAL_LM, model)) from None


def pick_device(choice: str, where: str) -> torch.device:
    """``auto``: the first GPU when there is one, else the CPU; a device that is not there is a one-line error."""
    import torch

    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(choice)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index or 0
        if count == 0 or index >= count:
            have = f"{count} GPU(s)" if count else "no GPU"
            raise ConfigError(f"{where}.device: {choice!r} is not available on this machine ({have}); use cpu or auto")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{where}.device: 'mps' is not available on this machine; use cpu or auto")
    return device


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads, then give the trainer back its own count.

    torch's intra-op pool is process-wide (``torch.set_num_threads``), so a reward cannot own threads of its own
    while the trainer waits on it; it borrows the pool for its call instead. The trainer is idle during the reward
    call (the step runs one phase at a time), and its count is restored before it computes again, so its numbers do
    not change. None: the trainer's count, untouched."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most ``size`` entries; a hit refreshes its entry, an insert past the bound drops the least recently used.
    ``size`` 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def peek(self, key: K) -> V | None:
        """The entry without refreshing it (held-out scoring reads the cache without reordering it)."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        if self.size <= 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def in_batches(items: list[Any], size: int, run: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``run`` over consecutive chunks of at most ``size`` items, results concatenated in order."""
    out: list[Any] = []
    for start in range(0, len(items), size):
        out.extend(run(items[start : start + size]))
    return out


def check_device_option(value: str) -> str | None:
    """Why ``value`` is not a device option (None when it is one); checked without importing torch."""
    if DEVICE.fullmatch(value):
        return None
    return f"must be one of {DEVICE_HINT}, got {value!r}"
