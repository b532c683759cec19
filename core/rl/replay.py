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


# How each kept field is laid out in a batch of rows: prompts are left-padded, completions right-padded; a [B] field
# (rewards, group ids, a per-row advantage) has no width. The fill value: the pad token for ids (None: the tokenizer
# has no pad token), False for masks, 0 for the per-token floats (Experience.concat's padding, value for value).
LAYOUT = {
    "prompt_ids": ("left", "pad"),
    "prompt_mask": ("left", False),
    "completion_ids": ("right", "pad"),
    "completion_mask": ("right", False),
    "behaviour_logprobs": ("right", 0),
    "rewards": ("right", 0),
    "advantages": ("right", 0),
    "group_ids": ("right", 0),
    "ref_logprobs": ("right", 0),
}


def gather_rows(sources: Sequence[tuple[Experience, torch.Tensor | None]], pad_token_id: int | None) -> Experience:
    """One batch of the kept fields of ``sources``' rows, in order: each ``(batch, rows)`` gives ``batch``'s ``rows``
    (a 1-D index tensor; None: all of them). The same tensors, bit for bit, as ``Experience.concat`` of each
    ``batch.select(rows)`` (widths: the widest source's prompt and completion), without its intermediate copies: each
    field is allocated once at its final shape and only the given rows are copied into it."""
    picks = [None if rows is None else rows.to(b.completion_ids.device) for b, rows in sources]
    counts = [b.batch_size if rows is None else int(rows.numel()) for b, rows in sources]
    widths = {
        "left": max(b.prompt_ids.shape[1] for b, _ in sources),
        "right": max(b.completion_ids.shape[1] for b, _ in sources),
    }
    fields: dict[str, Any] = {}
    for name, (side, fill) in LAYOUT.items():
        parts = [getattr(b, name) for b, _ in sources]
        if all(x is None for x in parts):
            fields[name] = None
            continue
        if any(x is None for x in parts):
            raise ValueError(f"ReplayBuffer.mix: {name} is set in some batches and not in others")
        value = (0 if pad_token_id is None else pad_token_id) if fill == "pad" else fill
        fields[name] = gather_field(name, parts, picks, counts, widths[side], side, value)
    return Experience(**fields, agent_ids=gather_agents(sources))


def gather_field(
    name: str,
    parts: Sequence[torch.Tensor],
    picks: Sequence[torch.Tensor | None],
    counts: Sequence[int],
    width: int,
    side: str,
    fill: Any,
) -> torch.Tensor:
    """One field of :func:`gather_rows`: ``parts[i]``'s rows ``picks[i]`` (None: all), stacked and padded on
    ``side`` to ``width`` with ``fill`` (a [B] field: no padding); the dtype the parts promote to, as torch.cat's."""
    import functools

    import torch

    dims = {x.dim() for x in parts}
    if len(dims) != 1 or not dims <= {1, 2}:
        raise ValueError(f"ReplayBuffer.mix: {name} has shapes {[list(x.shape) for x in parts]} across batches")
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in parts))
    shape = (sum(counts), width) if dims == {2} else (sum(counts),)
    out = torch.full(shape, fill, dtype=dtype, device=parts[0].device)
    start = 0
    for x, rows, n in zip(parts, picks, counts):
        target = out.narrow(0, start, n)  # narrow, not slicing: this loop runs fields x stored batches times a draw
        if x.dim() == 2 and x.shape[1] != width:
            target = target.narrow(1, width - x.shape[1] if side == "left" else 0, x.shape[1])
        if rows is None:
            target.copy_(x)
        elif target.is_contiguous() and x.dtype == dtype:
            torch.index_select(x, 0, rows, out=target)  # straight into place: the common case
        else:
            target.copy_(x.index_select(0, rows))  # a narrower or other-dtype source: via its picked rows only
        start += n
    return out


def gather_agents(sources: Sequence[tuple[Experience, torch.Tensor | None]]) -> list[Any]:
    out: list[Any] = []
    for b, rows in sources:
        out.extend(b.agent_ids if rows is None else [b.agent_ids[i] for i in rows.tolist()])
    return out


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
        # One copy of the kept rows, never two: with informative_only the row selection is that copy.
        kept = replay_fields(batch, copy=not self.informative_only)
        if self.informative_only:
            import torch

            informative = kept.advantages.reshape(kept.batch_size, -1).ne(0).any(-1)
            kept = kept.select(torch.nonzero(informative).flatten())
        self.batches.append(kept)

    def mix(self, batch: Experience, generator: torch.Generator, *, pad_token_id: int | None) -> Experience:
        """``batch``'s rows followed by up to ``rows`` stored rows (all re-padded with ``pad_token_id``); ``batch``
        itself when nothing is stored.

        The draw is a permutation of all stored rows (so its use of ``generator`` depends only on their number); the
        picked rows come in stored order. Only they are read: each field of the result is allocated once, at its
        final shape, and the fresh rows and the picked ones are copied straight into it (:func:`gather_rows`).
        """
        total = self.stored_rows
        if total == 0:
            return batch
        import torch

        picked = torch.randperm(total, generator=generator)[: self.rows].sort().values
        return gather_rows([(replay_fields(batch, copy=False), None), *self.drawn(picked)], pad_token_id)

    def drawn(self, picked: torch.Tensor) -> list[tuple[Experience, torch.Tensor]]:
        """``picked`` (sorted indices into the stored rows, oldest batch first) as (stored batch, its local rows)
        pairs, one per batch with a pick."""
        import torch

        sizes = torch.tensor([0] + [b.batch_size for b in self.batches])
        starts = sizes.cumsum(0)  # starts[i]: the first row of stored batch i; starts[-1] == total
        cuts = torch.searchsorted(picked, starts).tolist()  # picked[cuts[i]:cuts[i + 1]] fall in batch i
        return [
            (stored, picked[lo:hi] - int(starts[i]))
            for i, (stored, lo, hi) in enumerate(zip(self.batches, cuts, cuts[1:]))
            if hi > lo
        ]

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
