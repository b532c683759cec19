"""A word-usage environment: "write one sentence that uses these words". Single agent, single turn.

Each episode's metadata carries its words under ``"keywords"``, which is where the ``keyword_coverage``
reward looks for them by default, so the two work together without further configuration.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from palestra import DEFAULT_AGENT, Message, Observation, StepResult

DEFAULT_VOCABULARY = (
    "apple",
    "river",
    "lantern",
    "mountain",
    "violin",
    "harbour",
    "pepper",
    "glacier",
    "compass",
    "meadow",
    "thunder",
    "library",
    "orbit",
    "candle",
    "falcon",
    "desert",
)


@dataclass
class WordUsageOptions:
    """Options of the ``word_usage`` environment (a config sets them under ``environment.options``)."""

    num_words: int = 2
    vocabulary: list[str] = field(default_factory=lambda: list(DEFAULT_VOCABULARY))

    def __post_init__(self) -> None:
        if self.num_words < 1:
            raise ValueError(f"word_usage: num_words must be at least 1, got {self.num_words}")
        if len(set(self.vocabulary)) < self.num_words:
            raise ValueError(
                f"word_usage: vocabulary has {len(set(self.vocabulary))} distinct words, "
                f"fewer than num_words={self.num_words}"
            )


class WordUsageEnvironment:
    """Implements :class:`palestra.types.Environment` (structurally) for one agent and one turn."""

    agent_ids = (DEFAULT_AGENT,)
    max_turns = 1

    def __init__(self, **options: object) -> None:
        self.options = WordUsageOptions(**options)  # type: ignore[arg-type]
        self._vocabulary = sorted(set(self.options.vocabulary))
        self._rng = random.Random()
        self._rows = 0

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        if batch_size < 1 or group_size < 1:
            raise ValueError(f"word_usage: batch_size and group_size must be >= 1, got {batch_size} and {group_size}")
        rng = random.Random(seed) if seed is not None else self._rng
        observations = []
        for _ in range(batch_size):
            words = rng.sample(self._vocabulary, self.options.num_words)
            prompt = f"Write one short sentence that uses each of these words: {', '.join(words)}."
            for _ in range(group_size):  # one task per group: every row of the group gets the same words
                observations.append(
                    Observation(
                        prompt=prompt,
                        messages=[Message("user", prompt)],
                        metadata={"keywords": list(words)},
                    )
                )
        self._rows = len(observations)
        return observations

    def step(self, actions: Sequence[str | None]) -> StepResult:
        if len(actions) != self._rows:
            raise ValueError(f"word_usage: step() got {len(actions)} actions for a batch of {self._rows} rows")
        if any(a is None for a in actions):
            raise ValueError("word_usage: every row is live for its one turn, so no action may be None")
        n = len(actions)
        self._rows = 0  # every episode is over after its one turn
        return StepResult(
            observations=[None] * n,
            done=[True] * n,
            info=[
                {DEFAULT_AGENT: {"sentences": text.count(".") + text.count("!") + text.count("?")}} for text in actions
            ],
        )
