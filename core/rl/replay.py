"""Experience replay: the rows of the last few batches, and a uniform draw of them added to each update.

The design notes ask for replay with importance weights, so that the samples a CPU spends seconds generating are
learnt from more than once. What a replayed row carries is only what its loss needs again: the tokens, the
behaviour log-probs it was sampled with (the importance ratio's denominator), its reward and its advantage as
computed in its own batch, and the frozen reference's log-probs when the KL term needs them (the reference never
changes, so they stay valid). Value targets are never replayed: they go stale with the critic.

An algorithm opts in by deriving its options from :class:`palestra.engine.learner.ReplayOptions`; the learner then
builds the buffer, mixes it into every update and checkpoints it. The algorithm decides how a stale row is
corrected: REINFORCE truncates ``pi / mu`` at ``replay_is_clip``; the GRPO family's clipped surrogate already zeroes
the gradient of a row whose ratio left the clip range in the direction its advantage pushes (docs/learning.md
measures what replay buys).

``informative_only`` keeps only rows whose advantage is not 0. In a group-relative algorithm every row of a tied
group (all right, or all wrong) has advantage 0: replayed, it adds nothing but its entropy term, and on a hard task
where most groups tie it crowds the informative rows out of the draw.
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
FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "behaviour_logprobs",
    "rewards",
    "advantages",
    "group_ids",
)


def check_replay_options(capacity: int, rows: int) -> None:
    """An algorithm's ``replay_capacity`` and ``replay_rows`` are both 0 (no replay) or both positive; else a
    one-line :class:`~palestra.config.OptionError` naming the one left at 0 (for an options ``__post_init__``)."""
    if (capacity > 0) != (rows > 0):
        from palestra.config import OptionError

        key = "replay_rows" if capacity > 0 else "replay_capacity"
        raise OptionError(
            key,
            f"replay needs both replay_capacity and replay_rows > 0; got replay_capacity={capacity}, "
            f"replay_rows={rows}",
        )


def replay_fields(batch: Experience, *, copy: bool) -> Experience:
    """``batch`` with only the fields a replayed row keeps (detached; cloned with ``copy``, else sharing storage)."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if copy else t.detach()

    ref = batch.ref_logprobs
    kept: dict[str, Any] = {k: keep(getattr(batch, k)) for k in FIELDS}  # tensor fields, each by its name
    return Experience(
        **kept,
        agent_ids=list(batch.agent_ids),
        ref_logprobs=None if ref is None else keep(ref),
    )


class ReplayBuffer:
    """The rows of the last ``capacity`` batches; :meth:`mix` adds ``rows`` of them, drawn uniformly without
    replacement, to a fresh batch. Its state (:meth:`state`, :meth:`load`) goes into the algorithm's checkpoint, so
    that a resumed run replays exactly what the uninterrupted one would have."""

    def __init__(self, capacity: int, rows: int, *, informative_only: bool = False) -> None:
        if capacity < 1 or rows < 1:
            raise ValueError(f"ReplayBuffer: capacity and rows must be >= 1, got capacity={capacity}, rows={rows}")
        self.capacity, self.rows, self.informative_only = capacity, rows, informative_only
        self.batches: deque[Experience] = deque(maxlen=capacity)

    @property
    def stored_rows(self) -> int:
        return sum(b.batch_size for b in self.batches)

    def add(self, batch: Experience) -> None:
        """Keep ``batch``'s rows (with ``informative_only``, those whose advantage is not 0); the oldest batch goes
        once ``capacity`` are kept. A batch with no informative row still takes its place in the window."""
        kept = replay_fields(batch, copy=True)
        if self.informative_only:
            import torch

            informative = kept.advantages.reshape(kept.batch_size, -1).ne(0).any(-1)
            kept = kept.select(torch.nonzero(informative).flatten())
        self.batches.append(kept)

    def mix(self, batch: Experience, generator: torch.Generator, *, pad_token_id: int) -> Experience:
        """``batch``'s rows followed by up to ``rows`` stored rows (all re-padded with ``pad_token_id``); ``batch``
        itself when nothing is stored.

        The draw is a permutation of all stored rows (so its use of ``generator`` depends only on their number);
        only the picked rows are gathered, batch by batch, rather than the whole buffer.
        """
        total = self.stored_rows
        if total == 0:
            return batch
        import torch

        picked = torch.randperm(total, generator=generator)[: self.rows].sort().values
        sizes = torch.tensor([0] + [b.batch_size for b in self.batches])
        starts = sizes.cumsum(0)  # starts[i]: the first row of stored batch i; starts[-1] == total
        cuts = torch.searchsorted(picked, starts).tolist()  # picked[cuts[i]:cuts[i + 1]] fall in batch i
        pieces = [
            stored.select(picked[lo:hi] - int(starts[i]))
            for i, (stored, lo, hi) in enumerate(zip(self.batches, cuts, cuts[1:]))
            if hi > lo
        ]
        return Experience.concat([replay_fields(batch, copy=False), *pieces], pad_token_id=pad_token_id)

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
            self.batches.append(
                Experience(
                    **{k: rows[k].clone() for k in FIELDS},
                    agent_ids=list(rows["agent_ids"]),
                    ref_logprobs=None if ref is None else ref.clone(),
                )
            )
