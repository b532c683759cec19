"""Learning that holds across seeds (issue #15): the median of seeds 0, 1 and 2 learns the sums, not only a format.

Each assertion is on the MEDIAN held-out correctness over the three seeds, against the best constant answer (a
policy that ignores the question and always answers the most frequent sum: the plateau a collapsed run sits on).

* ``test_the_answer_alone_is_learnt_on_the_median_seed`` (CI, ~1.5 min): ``examples/grpo.yaml``'s policy and
  optimiser on the built-in sums with the answer as the first and only completion token, scored by exact
  correctness. This is where the tiny policy and GRPO learn the 25 sums in a few hundred steps (docs/learning.md,
  hypothesis (g)); a regression in the learner, the advantages or the policy shows here first.
* ``test_all_100_facts_are_learnt_on_the_tagged_task`` (CI, ~4 min): ``examples/hundred_facts.yaml`` as written,
  seed 0: the built-in tagged task on all 100 one-digit sums, the issue's hardest goal.
* ``test_every_example_learns_the_sums_on_the_median_seed`` (``PALESTRA_ROBUSTNESS=1``): every example config and
  the default run, as written (2000 steps each, 1200 for hundred_facts; 11 configs x 3 seeds, ~95 min on two cores),
  which is what ``bench/robustness.py`` measures. It is not in CI: it does not fit the budget. Measured on 2026-12-03
  (docs/learning.md, "Examples x seeds"), every config's median seed is above the constant-answer level.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from typing import Any

import background_runs
import pytest

from robustness import (  # bench/: on sys.path by pyproject's pytest pythonpath
    CONFIGS,
    config_path,
    run_one,
)

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.usefixtures("one_thread")]

SEEDS = (0, 1, 2)
HUNDRED_FACTS = "test_all_100_facts_are_learnt_on_the_tagged_task"


def constant_answer_accuracy(name: str) -> float:
    """The correctness of always answering the most frequent sum, for the config's operand range."""
    from palestra.config import load_config

    options = load_config(config_path(name)).environment.options
    top = options.max_operand if options.max_operand is not None else 9
    sums = Counter(a + b for a in range(top + 1) for b in range(top + 1))
    return max(sums.values()) / sum(sums.values())


def median_correctness(name: str, overrides: list[str]) -> tuple[float, list[float]]:
    runs: list[dict[str, Any]] = [run_one(name, seed, overrides) for seed in SEEDS]
    correctness = [r["correctness"] for r in runs]
    return statistics.median(correctness), correctness


def test_the_answer_alone_is_learnt_on_the_median_seed() -> None:
    # Measured 2026-12-03 (300 steps): held-out correctness 0.94, 0.89, see docs/learning.md for seed 2; the
    # constant answer scores 0.2. 64 held-out tasks: a constant answer scores 0.2 +- ~0.05, so 0.5 is far outside.
    # The three seeds train in the background from the session's start (tests/background_runs.py), as
    # median_correctness("grpo", [*BARE_ANSWER, "train.steps=300"]) would here.
    run, _ = background_runs.result("test_the_answer_alone_is_learnt_on_the_median_seed")
    assert run.returncode == 0, run.stderr[-3000:]
    each = json.loads(run.stdout.strip().splitlines()[-1])
    median = statistics.median(each)
    chance = constant_answer_accuracy("grpo")
    assert median >= 0.5 > 2 * chance, f"median held-out correctness {median:.3f} over seeds {SEEDS} (each: {each})"


def test_all_100_facts_are_learnt_on_the_tagged_task() -> None:
    # Measured 2026-12-03 (1200 steps, docs/learning.md): held-out correctness 0.95 / 0.91 / 0.95 / 0.89 / 0.92 on
    # seeds 0-4, every seed >= 0.8 by step 1100; the constant answer scores 0.1. One seed keeps CI's time down, and
    # 0.7 leaves room for another machine's rounding to take another trajectory.
    run, _ = background_runs.result("test_all_100_facts_are_learnt_on_the_tagged_task")  # trained in the background
    assert run.returncode == 0, run.stderr[-3000:]
    correctness = json.loads(run.stdout.strip().splitlines()[-1])  # run_one("hundred_facts", 0)["correctness"]
    chance = constant_answer_accuracy("hundred_facts")
    assert correctness >= 0.7 > 4 * chance, f"held-out correctness {correctness:.3f} on seed 0"


@pytest.mark.skipif(os.environ.get("PALESTRA_ROBUSTNESS") != "1", reason="~95 min: set PALESTRA_ROBUSTNESS=1")
@pytest.mark.parametrize("name", CONFIGS)
def test_every_example_learns_the_sums_on_the_median_seed(name: str) -> None:
    median, each = median_correctness(name, [])
    chance = constant_answer_accuracy(name)
    assert median >= 2 * chance, (
        f"{name}: median held-out correctness {median:.3f} over seeds {SEEDS} (each: {each}) is not above twice the "
        f"constant-answer level {chance:.3f}"
    )
