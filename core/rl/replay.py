"""Experience replay: the rows of the last few batches, and a uniform draw of them added to each update.

The design notes ask for replay with importance weights, so that the samples a CPU spends seconds generating are
learnt from more than once. What a replayed row carries is only what its loss needs again: the tokens, the
behaviour log-probs it was sampled with (the importance ratio's denominator), its reward and its advantage as
computed in its own batch, and the frozen reference's log-probs when the KL term needs them (the reference never
changes, so they stay valid). Value targets are never replayed: they go stale with the critic.

The algorithm decides how a stale row is corrected: REINFORCE truncates ``pi / mu`` at ``replay_is_clip``; the
GRPO family's clipped surrogate already zeroes the gradient of a row whose ratio left the clip range in the
direction its advantage pushes (docs/learning.md measures what replay buys).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palestra.types import Experience

if TYPE_CHECKING:
    import torch

# No torch at import time: options classes import check_replay_options while a config is only being read
# (`palestra config show` must stay light); the buffer's methods import it when they run.

__all__ = ["ReplayBuffer", "check_replay_options"]

# Per-row tensors every replayed row keeps; ref_logprobs is kept too when the batch has it.
FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behaviour_logprobs",
          "rewards", "advantages", "group_ids")


def check_replay_options(capacity: int, rows: int) -> None:
    """An algorithm's ``replay_capacity`` and ``replay_rows`` are both 0 (no replay) or both positive; else a
    one-line :class:`~palestra.config.OptionError` naming the one left at 0 (for an options ``__post_init__``)."""
    if (capacity > 0) != (rows > 0):
        from palestra.config import OptionError

        key = "replay_rows" if capacity > 0 else "replay_capacity"
        raise OptionError(key, f"replay needs both replay_capacity and replay_rows > 0; got replay_capacity={capacity}, "
                               f"replay_rows={rows}")


class ReplayBuffer:
    """The rows of the last ``capacity`` batches; :meth:`mix` adds ``rows`` of them, drawn uniformly without
    replacement, to a fresh batch. Its state (:meth:`state`, :meth:`load`) goes into the algorithm's checkpoint, so
    that a resumed run replays exactly what the uninterrupted one would have."""

    def __init__(self, capacity: int, rows: int) -> None:
        self.capacity, self.rows = capacity, rows
        self.batches: deque[Experience] = deque(maxlen=max(1, capacity))

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.rows > 0

    @staticmethod
    def stored_rows(batch: Experience) -> Experience:
        """A detached copy of ``batch`` with only what replay needs."""
        kept = {k: getattr(batch, k).detach().clone() for k in FIELDS}
        ref = batch.ref_logprobs
        return Experience(**kept, agent_ids=list(batch.agent_ids),
                          ref_logprobs=None if ref is None else ref.detach().clone())

    def add(self, batch: Experience) -> None:
        """Keep ``batch``'s rows (the oldest batch goes once ``capacity`` are kept)."""
        if self.enabled:
            self.batches.append(self.stored_rows(batch))

    def mix(self, batch: Experience, generator: torch.Generator, *, pad_token_id: int) -> Experience:
        """``batch``'s rows followed by up to ``rows`` stored rows (all re-padded with ``pad_token_id``); ``batch``
        itself when nothing is stored."""
        if not self.enabled or not self.batches:
            return batch
        import torch

        stored = Experience.concat(list(self.batches), pad_token_id=pad_token_id)
        k = min(self.rows, stored.batch_size)
        picked = stored.select(torch.randperm(stored.batch_size, generator=generator)[:k])
        return Experience.concat([self.stored_rows(batch), picked], pad_token_id=pad_token_id)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state(self) -> list[dict[str, Any]]:
        out = []
        for b in self.batches:
            rows: dict[str, Any] = {k: getattr(b, k) for k in FIELDS}
            rows["agent_ids"] = list(b.agent_ids)
            rows["ref_logprobs"] = b.ref_logprobs
            out.append(rows)
        return out

    def load(self, state: Sequence[Mapping[str, Any]]) -> None:
        self.batches.clear()
        for rows in state:
            ref = rows.get("ref_logprobs")
            self.batches.append(Experience(**{k: rows[k].clone() for k in FIELDS}, agent_ids=list(rows["agent_ids"]),
                                           ref_logprobs=None if ref is None else ref.clone()))
