"""Guess the number: a small multi-turn OpenEnv game (openenv-core's server API), served over HTTP and WebSocket.

The server picks a secret number in ``0..max_number`` from the reset seed; the player has ``tries`` guesses, and
after each wrong one learns whether the secret is higher or lower. Winning gives reward 1 on the winning step; every
other step gives 0, so an episode's summed reward is 1 for a win and 0 for a loss.

Observation fields: ``feedback`` (``start``, ``higher``, ``lower``, ``correct``, ``invalid``: the last guess had no
number in range), ``history`` (every guess so far, each followed by ``+`` when the secret is higher and ``-`` when it
is lower, e.g. ``5-2+``: a compact record a small policy can read) and ``guesses_left``. The action has one field,
``guess``: any text, whose first integer is the guess.

Serve it on loopback with uvicorn (``python -m uvicorn guess_number:app --app-dir examples/openenv_game --port 8000``)
or let palestra's ``openenv`` environment start it (``package: guess_number:app``, ``app_dir: examples/openenv_game``).
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

_NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    guess: str  # free text; its first integer is the guess


class GuessObservation(Observation):
    feedback: str = "start"
    history: str = ""
    guesses_left: int = 0


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    """One game per session; sessions share nothing, so the server may run many at once."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._secret = 0
        self._max_number = 9
        self._left = 0
        self._history = ""

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        max_number: int = 9,
        tries: int = 4,
        **kwargs: Any,
    ) -> GuessObservation:
        # the seed alone picks the secret, so a group of sessions reset with one seed plays one game
        self._max_number, self._left, self._history = int(max_number), int(tries), ""
        self._secret = random.Random(seed).randint(0, self._max_number)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(feedback="start", history="", guesses_left=self._left, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        self._left -= 1
        found = _NUMBER.search(action.guess)
        guess = int(found.group()) if found else None
        if guess is None or not 0 <= guess <= self._max_number:
            feedback = "invalid"
        elif guess == self._secret:
            feedback = "correct"
        else:
            feedback = "higher" if self._secret > guess else "lower"
            self._history += f"{guess}{'+' if feedback == 'higher' else '-'}"
        won = feedback == "correct"
        return GuessObservation(
            feedback=feedback,
            history=self._history,
            guesses_left=self._left,
            done=won or self._left <= 0,
            reward=1.0 if won else 0.0,
        )

    @property
    def state(self) -> State:
        return self._state


def make_app(environment: type[GuessNumberEnvironment] = GuessNumberEnvironment, sessions: int = 256) -> Any:
    """The FastAPI app serving ``environment`` (one instance per WebSocket session, up to ``sessions`` at once)."""
    return create_app(environment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=sessions)


app = make_app()
