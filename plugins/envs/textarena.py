"""Built-in environment ``textarena``: the text games of the `textarena <https://pypi.org/project/textarena/>`_
package (Tic-Tac-Toe, Rock-Paper-Scissors, Kuhn Poker, Nim, ...) as turn-based multi-agent episodes.

Needs the optional package: ``pip install "palestra[textarena]"``. Importing this module does not import
textarena; building the environment does, and without the package that is a one-line error saying how to install it.

**Players and agents.** Each player of the game that is not a fixed opponent is a Palestra agent named
``player_<id>`` (``player_0``, ``player_1``, ...). The game decides who acts: every observation is the acting
player's view (``agent_id`` is that player's agent), so turn order, hidden information and simultaneous-move
games (played as consecutive turns whose observations do not show each other's moves) are the game's own.
``opponents`` plays some players with a scripted policy inside the environment (they never reach the trainer):

* ``random``: a uniformly random valid move; ``first``: the first valid move, in the order the game lists its
  moves (Tic-Tac-Toe's lowest free cell, ``[rock]`` in Rock-Paper-Scissors, ``[check]`` in Kuhn Poker);
* ``fixed:<text>``: always the action ``<text>`` (e.g. ``fixed:[paper]``), valid or not.

Candidate moves are the bracketed moves the game's latest messages to that player show (``'[0]', '[4]'``,
``'[rock]'``), or the full move set for games that only show an example (Nim, Connect Four, Guess The
Number); a candidate is *valid* when the game accepts it, tried on a copy of the game.
:meth:`TextArenaEnv.legal_moves` gives the same list for any live observation (scripted players, tests, the
``{moves}`` prompt field).

**Invalid moves are the game's rules.** The action text goes to the game unchanged (through the game id's
wrappers: ``TicTacToe-v0`` wraps an action without brackets in brackets, ``TicTacToe-v0-raw`` does not). A move
the game rejects gets its warning and the same player acts again (a new turn, the game's message in the next
observation); textarena's two-player games let a player retry once, and a second invalid move in a row loses
the game (reward -1, the opponent +1). Each turn's info says whether the move was accepted and why not.

**Rewards come from the game's outcome.** When the game ends, the rewards textarena gives every player are
written to the episode's ``metadata["outcome"]`` (a record each observation of the episode shares, complete by
the time rewards run) and to the final step's info of every agent; the ``game_outcome`` reward (in this module)
scores each row by its agent's own result, so with ``agents.credit: role`` every agent trains on its own
outcome. An episode cut at ``max_turns`` before the game ended has ``outcome["finished"] = False``.

**Prompts.** ``prompt_template`` formats the observation with the fields ``{observation}`` (the game's own
rendering, as an LLM player of textarena sees it), ``{latest}`` (only the messages since the player's previous
turn, one ``[sender] text`` line each), ``{prompt}`` (the game's rules message), ``{board}`` (the newest board
message, or ""), ``{moves}`` (the valid moves, comma separated; computed only when the template uses it),
``{player}``, ``{agent}``, ``{game}`` and ``{turn}``. ``max_new_tokens`` caps each turn (as
``Observation.max_new_tokens``) and ``stop`` adds stop strings.

**Determinism.** textarena games draw from Python's global ``random``; every game here runs on its own saved
``random`` state (seeded from the task seed), so the same seed plays the same games, whatever the batch, the
order of the rows or anything else the process does with ``random``; the caller's ``random`` state is left as
it was. Rows of one group share a seed, so they start from the same deal. (Games drawing from NumPy's global
generator, a few of textarena's, are not covered.)
"""

from __future__ import annotations

import contextlib
import copy
import random
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from palestra import hookimpl
from palestra.config import OptionError, check_options, format_fields, option
from palestra.plugins.envs._episodes import draw_tasks, step_rows
from palestra.registry import MissingDependency, Requires
from palestra.types import Message, Observation, StepResult

INSTALL_HINT = 'pip install "palestra[textarena]"'
OPPONENT_KINDS = ("random", "first", "fixed:<action>")
TEMPLATE_FIELDS = ("observation", "latest", "prompt", "board", "moves", "player", "agent", "game", "turn")
GAME_ID = -1  # textarena's sender id for the game's own messages (textarena.GAME_ID)
_BRACKETED = re.compile(r"\[([^\[\]\n]{1,40})\]")
_PLAYER_COUNTS = (2, 1, 3, 4, 5, 6, 7, 8)  # tried in this order when num_players is not given
_MAX_SCRIPTED_MOVES = 10_000  # between two agent turns: more means a game that never hands the turn back


class GameSetupError(ValueError):
    """The options are well-formed but the game refuses them (an unknown game id, a player it does not have, ...).

    Raised when the environment is built; the message starts with the option's name (``game: ...``) and the
    config layer prefixes where it was built (``environment: building environment 'textarena' ... failed: ...``).
    """

    def __init__(self, key: str, message: str) -> None:
        self.key, self.message = key, " ".join(str(message).split())
        super().__init__(f"{key}: {self.message}")


def import_textarena() -> Any:
    """The ``textarena`` module, or a one-line :class:`~palestra.MissingDependency` naming the extra to install."""
    try:
        import textarena
    except ImportError as e:
        raise MissingDependency("the textarena environment", "textarena", INSTALL_HINT, cause=e) from None
    return textarena


def agent_name(player: int) -> str:
    """The Palestra agent id of textarena player ``player``."""
    return f"player_{player}"


@dataclass
class TextArenaOptions:
    # a textarena game id; "-raw" ids skip the game's wrappers, "-train" ids use its training wrappers
    game: str = "TicTacToe-v0"
    num_players: int | None = option(None, ge=1)  # None: the first count the game accepts of 2, 1, 3, 4, ..., 8
    opponents: dict[str, str] = field(default_factory=dict)  # player id -> "random" | "first" | "fixed:<action>"
    game_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the game (e.g. num_rounds: 3)
    max_turns: int = option(
        64, ge=1
    )  # Palestra turns per episode (retries after an invalid move count); then the episode is cut
    prompt_template: str = "{observation}"  # see the module docstring for the fields
    max_new_tokens: int | None = option(None, ge=1)  # each turn's token cap; None: train.max_new_tokens
    stop: list[str] = field(default_factory=list)  # extra stop strings for every turn

    def __post_init__(self) -> None:
        if not self.game.strip():
            raise OptionError("game", "must be a textarena game id such as 'TicTacToe-v0', got ''")
        for key, kind in self.opponents.items():
            if not key.isdigit():
                raise OptionError(f"opponents.{key}", "keys are player ids: '0', '1', ...")
            if kind not in ("random", "first") and not (kind.startswith("fixed:") and kind[len("fixed:") :]):
                raise OptionError(
                    f"opponents.{key}", f"unknown opponent {kind!r}; use one of {', '.join(OPPONENT_KINDS)}"
                )
        names = format_fields("prompt_template", self.prompt_template)
        for name in names:
            if name not in TEMPLATE_FIELDS:
                raise OptionError(
                    "prompt_template", f"unknown field {{{name}}}; the fields are {', '.join(TEMPLATE_FIELDS)}"
                )
        if any(not s for s in self.stop):
            raise OptionError("stop", "stop strings must not be empty")


@dataclass
class _Row:
    """One running game."""

    game: Any  # the textarena env (with its wrappers)
    seed: int
    rng: Any  # this game's saved state of Python's global random
    meta: dict[str, Any]  # the episode's metadata ("outcome" is filled in when the game ends)
    turn: int = 0  # Palestra turns taken
    player: int = -1  # who acts next
    done: bool = False
    history: dict[int, list[tuple[int, str, Any]]] = field(default_factory=dict)  # every message each player got
    latest: list[tuple[int, str, Any]] = field(default_factory=list)  # the acting player's new messages
    text: str = ""  # the acting player's rendered observation
    rejected: list[str] = field(default_factory=list)  # reasons of the invalid moves, in order
    observation: Observation | None = None  # None once the row is done


def _live_observation(row: _Row) -> Observation:
    """The observation a live row's last turn made (every row that is not done has one)."""
    assert row.observation is not None, "a live textarena row has its observation"
    return row.observation


class TextArenaEnv:
    """textarena games as batched, turn-based episodes. See the module docstring and
    :class:`palestra.types.Environment`."""

    def __init__(self, **options: Any) -> None:
        self.options: TextArenaOptions = check_options(TextArenaOptions, options, where="textarena")
        self._ta = import_textarena()
        o = self.options
        registry = self._ta.envs.registration.ENV_REGISTRY
        if o.game not in registry:
            import difflib

            close = difflib.get_close_matches(o.game, list(registry), n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise GameSetupError("game", f"unknown textarena game {o.game!r}{hint}")
        self.num_players = o.num_players if o.num_players is not None else self._infer_players()
        if o.num_players is not None:
            self._probe(o.num_players, raise_errors=True)
        self.opponents: dict[int, str] = {int(k): v for k, v in o.opponents.items()}
        for player in self.opponents:
            if player >= self.num_players:
                raise GameSetupError(f"opponents.{player}", f"{o.game} has players 0-{self.num_players - 1}")
        learners = [p for p in range(self.num_players) if p not in self.opponents]
        if not learners:
            raise GameSetupError(
                "opponents", "every player is a scripted opponent; leave at least one player to the agents"
            )
        self.agent_ids: tuple[str, ...] = tuple(agent_name(p) for p in learners)
        self.player_of: dict[str, int] = {agent_name(p): p for p in learners}
        self.max_turns = o.max_turns
        self._fields = {f for _, f, _, _ in string.Formatter().parse(o.prompt_template) if f}
        self._rng = random.Random()
        self._rows: list[_Row] = []

    # ---- building games ----------------------------------------------------------------------------------
    def _make(self) -> Any:
        return self._ta.make(self.options.game, **self.options.game_options)

    def _probe(self, players: int, *, raise_errors: bool = False) -> bool:
        """Whether the game starts with ``players`` players (under a throwaway random state).

        A wrong player count is an AssertionError or ValueError in textarena's games; any other failure (a word
        list that must be downloaded, a game that does not run on this Python) is raised at once.
        """
        with _saved_random():
            try:
                self._make().reset(num_players=players, seed=0)
            except Exception as e:  # noqa: BLE001 - sorted below: a wrong player count, or a game that cannot start
                if (
                    isinstance(e, TypeError) and self.options.game_options
                ):  # most likely a keyword the game does not take
                    raise GameSetupError(
                        "game_options", f"{self.options.game} could not start: {_one_line(e)}"
                    ) from None
                if not isinstance(e, (AssertionError, ValueError)):
                    raise GameSetupError("game", f"{self.options.game} could not start: {_one_line(e)}") from None
                if raise_errors:
                    raise GameSetupError(
                        "num_players", f"{self.options.game} does not start with {players} players: {_one_line(e)}"
                    ) from None
                return False
        return True

    def _infer_players(self) -> int:
        for n in _PLAYER_COUNTS:
            if self._probe(n):
                return n
        try:  # none worked: show the game's own error for two players
            self._probe(2, raise_errors=True)
        except GameSetupError as e:
            raise GameSetupError(
                "game", f"{self.options.game} would not start with any of {list(_PLAYER_COUNTS)} players ({e.message})"
            ) from None
        raise AssertionError("unreachable")

    # ---- protocol ----------------------------------------------------------------------------------------
    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        seeds = draw_tasks(lambda rng: rng.getrandbits(31), self._rng, batch_size, seed, group_size, "textarena")
        self._rows = [self._start(s) for s in seeds]
        return [_live_observation(r) for r in self._rows]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        # The game decides when a row ends; its next observation is made when its turn is played (_act).
        return step_rows("textarena", self._rows, actions, self._act, _live_observation, lambda row: row.done)

    # ---- scripted play and the legal-move helper -----------------------------------------------------------
    def legal_moves(self, observation: Observation) -> list[str]:
        """The valid moves (the game accepts them) for a live row's current ``observation``, in the game's order."""
        for row in self._rows:
            if row.observation is observation:
                with self._random(row):
                    return self._valid_moves(row, row.player)
        raise ValueError(
            "legal_moves: the observation is not the current observation of a running game of this environment"
        )

    # ---- one game ----------------------------------------------------------------------------------------
    def _start(self, seed: int) -> _Row:
        o = self.options
        outcome: dict[str, Any] = {
            "finished": False,
            "truncated": False,
            "rewards": None,
            "agent_rewards": None,
            "reason": None,
            "invalid_move": None,
            "turns": 0,
        }
        meta = {
            "game": o.game,
            "seed": seed,
            "num_players": self.num_players,
            "agents": dict(self.player_of),
            "opponents": {str(p): k for p, k in self.opponents.items()},
            "outcome": outcome,
        }
        row = _Row(game=self._make(), seed=seed, rng=None, meta=meta)
        with _saved_random():
            random.seed(seed)
            row.rng = random.getstate()
        with self._random(row):
            row.game.reset(num_players=self.num_players, seed=seed)
            self._record_invalid_moves(row.game.state, row.rejected)
            row.history = {p: [] for p in range(self.num_players)}
            self._play_opponents(row, [])
        if row.done:
            raise RuntimeError(
                f"textarena: {o.game} ended before any agent acted (seed {seed}); check the opponents option"
            )
        row.observation = self._observation(row)
        return row

    def _act(self, row: _Row, action: str) -> dict[str, dict[str, Any]]:
        """Apply the acting agent's ``action``, let the scripted players move, and return the step's info."""
        player = row.player
        agent = agent_name(player)
        with self._random(row):
            before = len(row.rejected)
            self._game_step(row, action)
            accepted = len(row.rejected) == before
            mine: dict[str, Any] = {
                "player": player,
                "action": action,
                "valid": accepted,
                "reason": None if accepted else row.rejected[-1],
            }
            scripted: list[dict[str, Any]] = []
            if not row.done:
                self._play_opponents(row, scripted)
            mine["opponent_moves"] = scripted
        row.turn += 1
        info: dict[str, dict[str, Any]] = {agent: mine}
        if row.done:
            self._finish(row)
            for a in self.agent_ids:  # every agent learns the result at the end, not only the one that moved last
                info.setdefault(a, {})["outcome"] = row.meta["outcome"]
            row.observation = None
        elif row.turn >= self.max_turns:
            row.done = True
            row.meta["outcome"].update(truncated=True, turns=row.turn, reason=f"cut at max_turns={self.max_turns}")
            for a in self.agent_ids:
                info.setdefault(a, {})["outcome"] = row.meta["outcome"]
            row.observation = None
        else:
            row.observation = self._observation(row)
        return info

    def _game_step(self, row: _Row, action: str) -> None:
        try:
            done, _ = row.game.step(action=action)
        except Exception as e:
            raise RuntimeError(
                f"textarena: {self.options.game} raised on player {row.player}'s action {action[:80]!r}: {_one_line(e)}"
            ) from e
        row.done = bool(done)

    def _play_opponents(self, row: _Row, moves: list[dict[str, Any]]) -> None:
        """Let the scripted players move until an agent's turn or the end; then read the acting player's view."""
        for _ in range(_MAX_SCRIPTED_MOVES):
            player, pending, text = self._read(row)
            row.player = player
            if row.done or player not in self.opponents:
                row.latest, row.text = pending, text
                return
            action = self._scripted_move(row, player)
            before = len(row.rejected)
            self._game_step(row, action)
            moves.append({"player": player, "action": action, "valid": len(row.rejected) == before})
            if row.done:
                return
        raise RuntimeError(
            f"textarena: the scripted players of {self.options.game} made {_MAX_SCRIPTED_MOVES} moves in a row "
            f"without the game ending or an agent's turn coming (seed {row.seed})"
        )

    def _read(self, row: _Row) -> tuple[int, list[tuple[int, str, Any]], str]:
        """The acting player, its new raw messages and its rendered observation (textarena hands each over once)."""
        state = row.game.state
        player = state.current_player_id
        if row.done:
            return player, [], ""
        pending = list(state.observations.get(player, []))  # what get_observation hands over (and clears)
        player_id, rendered = row.game.get_observation()
        row.history.setdefault(player_id, []).extend(pending)
        if not isinstance(rendered, str):  # a "-raw" game id: no wrapper renders the messages
            rendered = _render(row.history[player_id], state)
        return player_id, pending, rendered

    def _scripted_move(self, row: _Row, player: int) -> str:
        kind = self.opponents[player]
        if kind.startswith("fixed:"):
            return kind[len("fixed:") :]
        if kind == "first":
            moves = self._valid_moves(row, player, first_only=True)
            return moves[0] if moves else ""
        moves = self._valid_moves(row, player)
        return random.choice(moves) if moves else ""

    def _valid_moves(self, row: _Row, player: int, *, first_only: bool = False) -> list[str]:
        valid: list[str] = []
        for move in _candidate_moves(row, player, self._ta):
            if self._accepts(row, move):
                valid.append(move)
                if first_only:
                    break
        return valid

    def _accepts(self, row: _Row, action: str) -> bool:
        """Whether the game accepts ``action`` now: tried on a copy, leaving the game and its random state as they
        were."""
        saved = random.getstate()
        try:
            trial = copy.deepcopy(row.game)
            rejected: list[str] = []
            self._record_invalid_moves(trial.state, rejected)
            trial.step(action=action)
            return not rejected
        except Exception:  # noqa: BLE001 - a move the game cannot take, however it says so, is not accepted
            return False
        finally:
            random.setstate(saved)

    @staticmethod
    def _record_invalid_moves(state: Any, log: list[str]) -> None:
        """Note every ``set_invalid_move`` the game calls on ``state`` (its reason goes to ``log``)."""
        method = type(state).set_invalid_move

        def recording(*args: Any, **kwargs: Any) -> Any:
            reason = kwargs.get("reason", args[0] if args else None)
            log.append(str(reason))
            return method(state, *args, **kwargs)

        state.set_invalid_move = recording

    def _finish(self, row: _Row) -> None:
        rewards, game_info = row.game.close()
        outcome = row.meta["outcome"]
        if rewards is None:  # ended without a result (should not happen in textarena's games)
            outcome.update(turns=row.turn, reason="the game ended without rewards")
            return
        by_player = {int(p): float(r) for p, r in rewards.items()}
        game_info = game_info or {}
        outcome.update(
            finished=True,
            rewards={str(p): r for p, r in sorted(by_player.items())},
            agent_rewards={a: by_player.get(p, 0.0) for a, p in self.player_of.items()},
            reason=next(
                (str(i.get("reason")) for i in game_info.values() if isinstance(i, Mapping) and i.get("reason")), None
            ),
            invalid_move={
                str(p): bool(i.get("invalid_move", False)) for p, i in game_info.items() if isinstance(i, Mapping)
            },
            turns=row.turn,
        )

    # ---- observations --------------------------------------------------------------------------------------
    def _observation(self, row: _Row) -> Observation:
        o = self.options
        player = row.player
        agent = agent_name(player)
        history = row.history.get(player, [])
        fields: dict[str, Any] = {
            "observation": row.text,
            "latest": _render(row.latest, row.game.state),
            "prompt": next((m for _, m, t in history if _kind(t) == "PROMPT"), ""),
            "board": next((m for _, m, t in reversed(history) if _kind(t) == "GAME_BOARD"), ""),
            "player": player,
            "agent": agent,
            "game": o.game,
            "turn": row.turn,
        }
        if "moves" in self._fields:
            with self._random(row):
                fields["moves"] = ", ".join(self._valid_moves(row, player))
        else:
            fields["moves"] = ""
        text = o.prompt_template.format(**fields)
        return Observation(
            prompt=text,
            agent_id=agent,
            messages=[Message("user", text)],
            metadata={**row.meta, "state": self._joint_state(row)},
            stop=list(o.stop) or None,
            turn=row.turn,
            max_new_tokens=o.max_new_tokens,
        )

    def _joint_state(self, row: _Row) -> str:
        """Everything said in the game so far, newest last (a centralised critic's input; it keeps the end)."""
        logs = getattr(row.game.state, "logs", [])
        lines = [f"[{_sender(f, row.game.state)}] {' '.join(str(m).split())[:300]}" for f, m in logs[-16:]]
        return f"{self.options.game}, turn {row.turn}, player {row.player} to act\n" + "\n".join(lines)

    @contextlib.contextmanager
    def _random(self, row: _Row) -> Iterator[None]:
        """Run textarena code on this game's own random state (saved back afterwards); the caller's is restored."""
        outer = random.getstate()
        random.setstate(row.rng)
        try:
            yield
        finally:
            row.rng = random.getstate()
            random.setstate(outer)


# ---- helpers ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _saved_random() -> Iterator[None]:
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _one_line(e: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line, without the banner characters some libraries frame messages with."""
    text = " ".join(str(e).replace("*", " ").split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _kind(observation_type: Any) -> str:
    return getattr(observation_type, "name", str(observation_type))


def _sender(sender: int, state: Any) -> str:
    if sender == GAME_ID:
        return "GAME"
    return str(getattr(state, "role_mapping", {}).get(sender, f"Player {sender}"))


def _render(messages: Sequence[tuple[int, str, Any]], state: Any) -> str:
    """Messages as textarena's LLM observation wrapper writes them: one ``[sender] text`` per message."""
    return "\n".join(f"[{_sender(f, state)}] {m}" for f, m, _ in messages)


def _base_env(game: Any, ta: Any) -> Any:
    while isinstance(game, ta.Wrapper):
        game = game.env
    return game


def _all_moves(base: Any) -> list[str] | None:
    """Every move of games whose messages show only an example move; None for the others."""
    kind = type(base).__name__
    if kind == "NimEnv":
        piles = base.state.game_state["piles"]
        return [f"[{i} {q}]" for i, n in enumerate(piles) for q in range(1, n + 1)]
    if kind == "ConnectFourEnv":
        return [f"[col {c}]" for c in range(base.num_cols)]
    if kind == "GuessTheNumberEnv":
        return [f"[{n}]" for n in range(base.min_number, base.max_number + 1)]
    return None


def _candidate_moves(row: _Row, player: int, ta: Any) -> list[str]:
    """Moves to try for ``player``: the game's full move set where known, else the bracketed moves its messages show."""
    known = _all_moves(_base_env(row.game, ta))
    if known is not None:
        return known
    state = row.game.state
    tags = {f"[{name}]" for name in getattr(state, "role_mapping", {}).values()}
    found: list[str] = []
    for sender, message, _ in reversed(row.history.get(player, [])):  # newest message first
        if sender != GAME_ID:
            continue
        for m in _BRACKETED.finditer(str(message)):
            move = f"[{m.group(1).strip()}]"
            if move not in tags and move not in found:
                found.append(move)
    return found


# ---- the outcome reward ------------------------------------------------------------------------------------
@dataclass
class GameOutcomeOptions:
    win: float | None = None  # a won game's reward; None: the game's own (textarena's two-player games: 1)
    draw: float | None = None  # a drawn game's reward; None: the game's own (0)
    loss: float | None = None  # a lost game's reward; None: the game's own (-1)
    unfinished: float = 0.0  # an episode cut at max_turns before the game ended


def result_of(reward: float) -> str:
    """``"win"``, ``"draw"`` or ``"loss"`` by the sign of a player's textarena reward."""
    return "win" if reward > 0 else "loss" if reward < 0 else "draw"


class GameOutcomeReward:
    """Each row's agent's own result of the game (``metadata["outcome"]``, written by the ``textarena`` environment).

    By default the game's own reward (textarena's two-player games: 1 win, 0 draw, -1 loss; single-player games:
    their score); ``win``/``draw``/``loss`` replace it by the result's sign. Components (0/1 per row, logged as
    ``reward/<name>`` and ``eval/<name>``): ``win``, ``draw``, ``loss``, ``invalid`` (the agent lost the game by
    its own invalid moves) and ``unfinished``.
    """

    def __init__(self, **options: Any) -> None:
        self.options: GameOutcomeOptions = check_options(GameOutcomeOptions, options, where="game_outcome")
        self.max_score = self.options.win

    def score(self, meta: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        outcome = meta.get("outcome")
        agent = meta.get("agent_id")
        if not isinstance(outcome, Mapping):
            raise ValueError(
                "the row's metadata has no 'outcome': game_outcome scores episodes of the textarena environment"
            )
        flags = dict.fromkeys(("win", "draw", "loss", "invalid", "unfinished"), 0.0)
        if not outcome.get("finished"):
            flags["unfinished"] = 1.0
            return self.options.unfinished, flags
        player = (meta.get("agents") or {}).get(agent)
        if player is None:
            raise ValueError(
                f"agent {agent!r} is not a player of this game (agents: {sorted(meta.get('agents') or {})})"
            )
        raw = float(outcome["rewards"].get(str(player), 0.0))
        result = result_of(raw)
        flags[result] = 1.0
        flags["invalid"] = float(result == "loss" and bool((outcome.get("invalid_move") or {}).get(str(player))))
        value = getattr(self.options, result)
        return (raw if value is None else float(value)), flags

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Any:
        import torch

        from palestra.types import RewardOutput

        scored = [self.score(m) for m in metadata]
        scores = torch.tensor([s for s, _ in scored], dtype=torch.float32)
        names = ("win", "draw", "loss", "invalid", "unfinished")
        components = {n: torch.tensor([f[n] for _, f in scored], dtype=torch.float32) for n in names}
        return RewardOutput(scores, components)


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "textarena",
        Requires(TextArenaEnv, module="textarena", install=INSTALL_HINT),
        options=TextArenaOptions,
        description=(
            f"textarena's text games (TicTacToe-v0, IteratedRockPaperScissors-v0, ...), one agent per player "
            f"({INSTALL_HINT})"
        ),
    )


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "game_outcome",
        GameOutcomeReward,
        options=GameOutcomeOptions,
        description="textarena: each agent's own game result (win/draw/loss, or the game's score)",
    )
