"""The ``textarena`` environment (textarena's text games, one agent per player) and the ``game_outcome`` reward.

The tests that play games need the optional ``textarena`` package (``pip install "palestra[textarena]"``) and are
skipped with that reason without it; the light-import and missing-package tests run either way.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from palestra.config import ConfigError, build_component, load_config
from palestra.engine.rollout import reward_rows, run_episodes
from palestra.multiagent.credit import credit_plan
from palestra.plugin_manager import get_registry
from palestra.plugins.envs import textarena as ta_env
from palestra.plugins.envs.textarena import TextArenaEnv
from palestra.registry import MissingDependency, Registration
from palestra.types import Environment, Observation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "textarena_rps.yaml"

try:
    import textarena  # noqa: F401

    HAVE_TEXTARENA = True
except ImportError:
    HAVE_TEXTARENA = False
needs_textarena = pytest.mark.skipif(
    not HAVE_TEXTARENA, reason='needs the textarena package: pip install "palestra[textarena]"'
)

GAMES = ("TicTacToe-v0", "IteratedRockPaperScissors-v0", "KuhnPoker-v0")


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    """The environment and the reward in the registry (they are once the ``textarena`` entry point is installed)."""
    registry = get_registry()
    added: list[tuple[str, str]] = []
    for kind, hook in (("environment", ta_env.register_environments), ("reward", ta_env.register_rewards)):

        def register(name: str, factory: Any, options: Any = None, description: str = "", kind: str = kind) -> None:
            if name not in registry.names(kind):
                registry.add(Registration(kind, name, factory, options, description, "textarena", "palestra"))
                added.append((kind, name))

        hook(register=register)
    yield
    for key in added:
        registry._items.pop(key, None)


def env(**options: Any) -> Any:
    return build_component("environment", {"name": "textarena", "options": options}, path="environment")


def outcome_reward(**options: Any) -> Any:
    return build_component("reward", {"name": "game_outcome", "options": options}, path="reward")


def random_player(e: TextArenaEnv, seed: int) -> Any:
    """A random valid move, drawn per game and turn (so a game's moves do not depend on the rest of its batch)."""
    return lambda obs: [random.Random(f"{seed}/{o.metadata['seed']}/{o.turn}").choice(e.legal_moves(o)) for o in obs]


def first_player(e: TextArenaEnv) -> Any:
    return lambda obs: [e.legal_moves(o)[0] for o in obs]


def scripted(moves: dict[str, list[str]]) -> Any:
    """Plays each agent's listed moves in order."""
    played: dict[int, dict[str, int]] = {}

    def respond(obs: list[Observation]) -> list[str]:
        out = []
        for o in obs:
            n = played.setdefault(id(o.metadata["outcome"]), {}).setdefault(o.agent_id, 0)
            played[id(o.metadata["outcome"])][o.agent_id] = n + 1
            out.append(moves[o.agent_id][n])
        return out

    return respond


# ---- without the package ---------------------------------------------------------------------------------------
def test_importing_the_plugin_does_not_import_textarena() -> None:
    code = (
        "import sys; import palestra.plugins.envs.textarena; from palestra.plugin_manager import get_registry; "
        "get_registry(); print('textarena' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_without_the_package_building_it_is_a_one_line_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena now raises ImportError
    with pytest.raises(ConfigError) as e:
        env(game="TicTacToe-v0")
    msg = str(e.value)
    assert 'pip install "palestra[textarena]"' in msg and "\n" not in msg and msg.startswith("environment.name: ")
    with pytest.raises(MissingDependency) as missing:
        ta_env.import_textarena()
    assert str(missing.value) == (
        "the textarena environment needs the Python package 'textarena', which is not installed; "
        'install it with: pip install "palestra[textarena]"'
    )


def test_options_are_checked_before_the_package_is_needed() -> None:
    with pytest.raises(
        ConfigError, match=r"opponents\.1: unknown opponent 'smart'; use one of random, first, fixed:<action>"
    ):
        env(opponents={"1": "smart"})
    with pytest.raises(ConfigError, match=r"opponents\.x: keys are player ids"):
        env(opponents={"x": "random"})
    with pytest.raises(ConfigError, match=r"prompt_template: unknown field \{bord\}"):
        env(prompt_template="{bord}")
    with pytest.raises(ConfigError, match=r"^reward\.options\.unfinished: expected a float"):
        outcome_reward(unfinished="no")


def test_the_example_config_validates() -> None:
    config = load_config(EXAMPLE)
    assert config.environment.name == "textarena" and config.reward.name == "game_outcome"
    assert config.environment.options.opponents == {"1": "first"}


# ---- with the package -------------------------------------------------------------------------------------------
@needs_textarena
def test_registered_and_protocol() -> None:
    e = env(game="TicTacToe-v0", opponents={"1": "random"})
    assert isinstance(e, Environment)
    assert e.agent_ids == ("player_0",) and e.num_players == 2 and e.max_turns == 64
    both = env(game="KuhnPoker-v0")
    assert both.agent_ids == ("player_0", "player_1")
    assert env(game="GuessTheNumber-v0").num_players == 1  # inferred: the game refuses 2 players


@needs_textarena
def test_bad_game_ids_and_players_are_one_line_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"game: unknown textarena game 'TicTacToe-v9'; did you mean 'TicTacToe-v0'"
    ) as e:
        env(game="TicTacToe-v9")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"opponents\.2: TicTacToe-v0 has players 0-1"):
        env(game="TicTacToe-v0", opponents={"2": "random"})
    with pytest.raises(ConfigError, match=r"opponents: every player is a scripted opponent"):
        env(game="TicTacToe-v0", opponents={"0": "random", "1": "first"})
    with pytest.raises(ConfigError, match=r"num_players: TicTacToe-v0 does not start with 3 players"):
        env(game="TicTacToe-v0", num_players=3)
    with pytest.raises(
        ConfigError, match=r"game_options: IteratedRockPaperScissors-v0 could not start: TypeError: .*'rounds'"
    ):
        env(game="IteratedRockPaperScissors-v0", game_options={"rounds": 3})


@needs_textarena
@pytest.mark.parametrize("game", GAMES)
@pytest.mark.parametrize("policy", ["random", "first"])
def test_random_and_fixed_policies_finish_games(game: str, policy: str) -> None:
    """Self-play and against a scripted opponent: every game ends with the game's own result, every move valid."""
    for opponents in ({}, {"1": policy}):
        e = env(game=game, opponents=opponents)
        respond = random_player(e, 3) if policy == "random" else first_player(e)
        episodes = run_episodes(e, respond, 6, seed=11)
        for ep in episodes:
            out = ep.metadata["outcome"]
            assert out["finished"] and not out["truncated"] and not ep.truncated
            assert sorted(out["rewards"].values()) in ([-1.0, 1.0], [0.0, 0.0])  # zero-sum two-player results
            assert all(t.info["valid"] for t in ep.turns)
            assert {t.agent_id for t in ep.turns} <= set(e.agent_ids)
            assert all(t.agent_id == f"player_{t.info['player']}" for t in ep.turns)
            assert ep.last.info["outcome"] is out  # the final step reports the result
            assert out["turns"] == len(ep.turns)
            for t in ep.turns:  # the scripted players' moves are reported, and none of them reaches the agents
                assert all(str(m["player"]) in opponents and m["valid"] for m in t.info["opponent_moves"])


@needs_textarena
def test_rock_paper_scissors_against_first_and_fixed_opponents() -> None:
    first = env(game="IteratedRockPaperScissors-v0", opponents={"1": "first"}, game_options={"num_rounds": 3})
    ep = run_episodes(first, lambda obs: ["[paper]"] * len(obs), 1, seed=0)[0]
    assert [m["action"] for t in ep.turns for m in t.info["opponent_moves"]] == [
        "[rock]"
    ] * 3  # "first": the first listed move
    assert ep.metadata["outcome"]["agent_rewards"] == {"player_0": 1.0}
    fixed = env(
        game="IteratedRockPaperScissors-v0", opponents={"0": "fixed:[scissors]"}, game_options={"num_rounds": 3}
    )
    ep = run_episodes(fixed, lambda obs: ["[paper]"] * len(obs), 1, seed=0)[0]
    assert fixed.agent_ids == ("player_1",) and ep.metadata["outcome"]["rewards"] == {"0": 1.0, "1": -1.0}
    assert outcome_reward()(*reward_rows([ep])).scores.tolist() == [-1.0]


@needs_textarena
def test_agent_ids_and_rewards_map_to_players() -> None:
    """Tic-Tac-Toe self-play where player 1 wins (row 3-4-5): the winner gets the win reward, per agent."""
    e = env(game="TicTacToe-v0")
    moves = {"player_0": ["[0]", "[1]", "[8]"], "player_1": ["[3]", "[4]", "[5]"]}
    ep = run_episodes(e, scripted(moves), 1, seed=0)[0]
    assert [t.agent_id for t in ep.turns] == ["player_0", "player_1"] * 3
    out = ep.metadata["outcome"]
    assert out["rewards"] == {"0": -1.0, "1": 1.0} and out["agent_rewards"] == {"player_0": -1.0, "player_1": 1.0}
    assert "Player 1 has won" in out["reason"]
    # every agent's own last turn scores its own result, with the default and with custom values
    for reward, want in (
        (outcome_reward(), {"player_0": -1.0, "player_1": 1.0}),
        (outcome_reward(win=2.0, draw=0.5, loss=-3.0), {"player_0": -3.0, "player_1": 2.0}),
    ):
        for agent, value in want.items():
            scored = reward(*reward_rows([ep], agent))
            assert scored.scores.tolist() == [value]
            assert scored.components["win"].tolist() == [float(agent == "player_1")]
    # role credit (what the trainer does with agents.credit: role) gives each agent's rows its own result
    reward = outcome_reward()
    plan = credit_plan([ep], e.agent_ids, "role")
    _, scores, metrics = plan.assign(reward(*plan.rows))
    assert {a: s.tolist() for a, s in scores.items()} == {"player_0": [-1.0], "player_1": [1.0]}
    assert metrics == {"reward/agent/player_0": -1.0, "reward/agent/player_1": 1.0}


@needs_textarena
def test_the_player_who_moves_first_in_kuhn_poker_is_player_1() -> None:
    e = env(game="KuhnPoker-v0", game_options={"max_rounds": 1})
    ep = run_episodes(e, lambda obs: ["[fold]" if o.turn else "[bet]" for o in obs], 1, seed=4)[0]
    assert [t.agent_id for t in ep.turns] == ["player_1", "player_0"]  # Kuhn Poker's first round starts with player 1
    assert ep.metadata["outcome"]["agent_rewards"] == {"player_0": -1.0, "player_1": 1.0}  # player 0 folded


@needs_textarena
def test_invalid_moves_follow_the_games_rules() -> None:
    """textarena's two-player rule: an invalid move is announced and retried; a second one in a row loses."""
    e = env(game="TicTacToe-v0", opponents={"1": "random"})
    ep = run_episodes(e, lambda obs: ["hello"] * len(obs), 1, seed=0)[0]
    assert len(ep.turns) == 2 and [t.info["valid"] for t in ep.turns] == [False, False]
    assert "does not follow the correct format" in ep.turns[0].info["reason"]
    assert "attempted an invalid move" in ep.turns[1].observation.prompt  # the game's warning, then a retry
    out = ep.metadata["outcome"]
    assert out["rewards"] == {"0": -1.0, "1": 1.0} and out["invalid_move"] == {"0": True, "1": False}
    scored = outcome_reward()(*reward_rows([ep]))
    assert scored.scores.tolist() == [-1.0] and scored.components["invalid"].tolist() == [1.0]

    # one invalid move, then valid ones: the game goes on
    e = env(game="TicTacToe-v0", opponents={"1": "first"}, prompt_template="{latest}")
    ep = run_episodes(e, lambda obs: ["[9]" if o.turn == 0 else e.legal_moves(o)[0] for o in obs], 1, seed=0)[0]
    assert [t.info["valid"] for t in ep.turns][:2] == [False, True] and ep.turns[0].info["opponent_moves"] == []
    assert ep.turns[1].observation.prompt.startswith(
        "[Player 0] [9]\n[GAME] Player 0 attempted an invalid move. Reason: 9."
    )
    assert ep.metadata["outcome"]["finished"] and ep.metadata["outcome"]["invalid_move"] == {"0": False, "1": False}

    # a scripted opponent that plays an invalid move loses the same way
    e = env(game="IteratedRockPaperScissors-v0", opponents={"1": "fixed:[lizard]"})
    ep = run_episodes(e, lambda obs: ["[rock]"] * len(obs), 1, seed=0)[0]
    assert [m["valid"] for m in ep.turns[0].info["opponent_moves"]] == [False, False]
    assert ep.metadata["outcome"]["rewards"] == {"0": 1.0, "1": -1.0} and ep.metadata["outcome"]["invalid_move"]["1"]


@needs_textarena
def test_an_episode_cut_at_max_turns_is_unfinished() -> None:
    e = env(game="TicTacToe-v0", max_turns=3)
    eps = run_episodes(e, first_player(e), 2, seed=0)
    for ep in eps:
        assert len(ep.turns) == 3 and not ep.truncated  # the environment ends the episode itself
        assert ep.metadata["outcome"]["truncated"] and not ep.metadata["outcome"]["finished"]
    for agent in e.agent_ids:
        scored = outcome_reward(unfinished=-0.5)(*reward_rows(eps, agent))
        assert scored.scores.tolist() == [-0.5, -0.5] and scored.components["unfinished"].tolist() == [1.0, 1.0]


@needs_textarena
def test_seeded_games_are_deterministic_and_leave_the_callers_random_alone() -> None:
    def play(seed: int, batch: int, group: int = 1) -> list[tuple[Any, ...]]:
        e = env(game="KuhnPoker-v0", opponents={"1": "random"})  # random deals and a random opponent
        eps = run_episodes(e, random_player(e, 0), batch, seed=seed, group_size=group)
        return [
            (
                ep.turns[0].observation.prompt,
                ep.transcript(),
                ep.metadata["outcome"]["rewards"],
                [m["action"] for t in ep.turns for m in t.info["opponent_moves"]],
            )
            for ep in eps
        ]

    random.seed(123)
    expected = random.random()
    random.seed(123)
    a = play(5, 4)
    assert random.random() == expected  # the games ran on their own random states
    assert a == play(5, 4)
    assert play(5, 1)[0] == a[0]  # a game does not depend on the other games of its batch
    assert len({p for p, *_ in play(6, 8)}) > 1  # other seeds, other deals
    grouped = play(5, 2, group=2)  # a group's rows share one deal
    assert grouped[0][0] == grouped[1][0] and grouped[2][0] == grouped[3][0]


@needs_textarena
def test_prompt_template_fields_and_turn_caps() -> None:
    e = env(
        game="TicTacToe-v0",
        opponents={"1": "first"},
        max_new_tokens=2,
        stop=["\n"],
        prompt_template="{game} {agent} (player {player}) turn {turn}\n{board}\nmoves: {moves}\nlatest: {latest}",
    )
    obs = e.reset(1, seed=0)[0]
    assert obs.prompt.startswith("TicTacToe-v0 player_0 (player 0) turn 0\nCurrent Board:")
    assert "moves: [0], [1], [2], [3], [4], [5], [6], [7], [8]\n" in obs.prompt
    assert obs.max_new_tokens == 2 and obs.stop == ["\n"] and obs.agent_id == "player_0" and obs.turn == 0
    assert obs.metadata["state"].startswith("TicTacToe-v0, turn 0, player 0 to act")
    nxt = e.step(["[4]"]).observations[0]
    assert nxt is not None and "moves: [1], [2], [3], [5], [6], [7], [8]\n" in nxt.prompt  # the opponent took [0]
    assert "[Player 1] [0]" in nxt.metadata["state"]
    with pytest.raises(ValueError, match="not the current observation"):
        e.legal_moves(obs)
    raw = env(game="TicTacToe-v0-raw", opponents={"1": "first"})  # no wrapper: the messages are rendered here
    assert raw.reset(1, seed=0)[0].prompt.startswith("[GAME] You are Player 0 in Tic Tac Toe.")


@needs_textarena
def test_other_games_and_single_player_scores() -> None:
    e = env(game="GuessTheNumber-v0")
    eps = run_episodes(e, random_player(e, 1), 4, seed=2)
    scores = outcome_reward()(*reward_rows(eps)).scores.tolist()
    assert all(ep.metadata["outcome"]["finished"] for ep in eps) and all(0.0 <= s <= 1.0 for s in scores)
    nim = env(game="Nim-v0", opponents={"0": "random"})  # Nim lists no moves: its full move set is tried
    assert nim.agent_ids == ("player_1",)
    assert all(ep.metadata["outcome"]["finished"] for ep in run_episodes(nim, random_player(nim, 2), 4, seed=3))


@needs_textarena
@pytest.mark.slow
def test_the_example_trains_a_few_steps(tmp_path: Path, one_thread: None) -> None:
    from palestra.engine.trainer import Trainer

    config = load_config(EXAMPLE, ["loggers=[]", "train.steps=2", "train.batch_size=4", "train.eval_size=4"])
    trainer = Trainer(config, run_dir=tmp_path)
    metrics = trainer.step()
    assert {"reward/win", "reward/loss", "reward/invalid", "reward/agent/player_0"} <= set(metrics)
    assert trainer.evaluate(4).components.keys() >= {"win", "draw", "loss"}
