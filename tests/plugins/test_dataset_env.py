"""The ``dataset`` environment (plugins/envs/dataset.py): JSONL, CSV, Parquet and ``datasets.load_from_disk``
folders, column mapping, the held-out split, seeding, the one-line errors, the contract kit and a 2-step run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import pytest

from palestra import cli
from palestra.config import ConfigError, build_component, load_config
from palestra.plugins.envs.dataset import DatasetEnv
from palestra.testing import check_environment

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
ROWS = [{"question": f"{a} + {b}", "answer": a + b, "level": a % 3} for a in range(5) for b in range(4)]  # 20 rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def env(path: Path | str, **options: Any) -> DatasetEnv:
    return build_component(
        "environment", {"name": "dataset", "options": {"path": str(path), **options}}, path="environment"
    )


def error(path: Path | str, **options: Any) -> str:
    with pytest.raises(ConfigError) as info:
        env(path, **options)
    return str(info.value)


def tasks(e: DatasetEnv, n: int = 4, seed: int = 1) -> list[tuple[str, str, Any]]:
    return [(o.prompt, o.metadata["answer"], o.metadata.get("level")) for o in e.reset(n, seed=seed)]


# ---- formats ------------------------------------------------------------------------------------------
def test_every_format_reads_the_same_tasks(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    files = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS),
        "csv": write_csv(tmp_path / "d.csv", ROWS),
        "parquet": tmp_path / "d.parquet",
        "disk": tmp_path / "saved",
        "dict": tmp_path / "saved_dict",
    }
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(files["parquet"]))
    table.save_to_disk(str(files["disk"]))
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(str(files["dict"]))
    seen = {}
    for kind, path in files.items():
        e = env(path, metadata_columns=["level"])
        assert len(e.train_tasks) == 18 and len(e.eval_tasks) == 2  # eval_fraction 0.1 of 20
        # CSV cells are text, so compare the metadata as text
        seen[kind] = [(p, a, str(level)) for p, a, level in tasks(e)]
    assert all(v == seen["jsonl"] for v in seen.values()), seen
    assert seen["jsonl"][0][1] == str(next(r["answer"] for r in ROWS if r["question"] == seen["jsonl"][0][0]))
    # a DatasetDict folder reads the split data_split names; format may also be set explicitly
    assert len(env(files["dict"], data_split="test", eval_fraction=0).train_tasks) == 2
    assert len(env(files["jsonl"].rename(tmp_path / "d.txt"), format="jsonl").train_tasks) == 18
    assert error(files["dict"], data_split="dev") == (
        f"environment.options.data_split: {files['dict']} has no split 'dev'; its splits are train, test"
    )


# ---- column mapping -----------------------------------------------------------------------------------
def test_columns_template_system_prompt_and_metadata(tmp_path: Path) -> None:
    rows = [{"q": "2 + 2", "gold": "4", "src": "a", "id": 7}, {"q": "1 + 1", "gold": "2", "src": "b", "id": 8}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    e = env(
        path,
        prompt_column="q",
        answer_column="gold",
        metadata_columns=["src", "id"],
        eval_fraction=0,
        system_prompt="Answer briefly.",
        stop=["</answer>"],
    )
    obs = {o.metadata["id"]: o for o in e.reset(2, seed=0)}
    assert obs[7].prompt == "Answer briefly.\n\n2 + 2" and obs[7].metadata == {
        "answer": "4",
        "row": 0,
        "src": "a",
        "id": 7,
    }
    assert [(m.role, m.content) for m in obs[7].messages] == [("system", "Answer briefly."), ("user", "2 + 2")]
    assert obs[7].stop == ["</answer>"]
    templated = env(path, template="Q{id}: {q} =", answer_column="gold", eval_fraction=0)
    assert sorted(o.prompt for o in templated.reset(2, seed=0)) == ["Q7: 2 + 2 =", "Q8: 1 + 1 ="]
    result = templated.step(["<answer>4</answer>", "x"])
    assert result.done == [True, True] and {i["assistant"]["expected"] for i in result.info} == {"4", "2"}


def test_a_messages_column(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Hi, what is 3 + 4?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat, "answer": 7}])
    (o,) = env(path, messages_column="messages", system_prompt="Be brief.", eval_fraction=0).reset(1, seed=0)
    assert [(m.role, m.content) for m in o.messages] == [("system", "Be brief."), ("user", "Hi, what is 3 + 4?")]
    assert o.prompt == "system: Be brief.\nuser: Hi, what is 3 + 4?" and o.metadata["answer"] == "7"
    # in a CSV the messages are the JSON text of the list
    csv_path = write_csv(tmp_path / "chat.csv", [{"messages": json.dumps(chat), "answer": 7}])
    assert (
        env(csv_path, messages_column="messages", eval_fraction=0).reset(1, seed=0)[0].messages[0].content
        == chat[0]["content"]
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}], "answer": 1}])
    assert error(bad, messages_column="messages").startswith(
        f"environment.options.path: {bad} line 1: messages ('messages') item 0 must be {{role: str, content: str}}"
    )


# ---- held-out split and seeding ---------------------------------------------------------------------------
def prompts(e: DatasetEnv) -> set[str]:
    return {o.prompt for o in e.reset(len(e.pool), seed=0)}


def test_the_held_out_rows_are_never_drawn_for_training(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    e = env(path, eval_size=5)
    train, held = prompts(e), prompts(e.held_out())
    assert len(train) == 15 and len(held) == 5 and not train & held
    assert prompts(env(path, eval_size=5, split="eval")) == held
    # many seeded training batches never touch a held-out row
    drawn = {o.prompt for seed in range(50) for o in e.reset(8, seed=seed)}
    assert drawn <= train and not drawn & held
    # split_seed picks which rows; the same for every instance
    assert prompts(env(path, eval_size=5).held_out()) == held
    assert prompts(env(path, eval_size=5, split_seed=1).held_out()) != held
    # eval_fraction rounds, holding out at least one row; 0 holds out none
    assert len(env(path, eval_fraction=0.25).eval_tasks) == 5 and len(env(path, eval_fraction=0.01).eval_tasks) == 1
    assert env(path, eval_fraction=0).eval_tasks == []
    # eval_path: that whole file is the held-out split, all of path trains
    other = write_jsonl(tmp_path / "test.jsonl", [{"question": "9 + 9", "answer": 18, "level": 0}])
    separate = env(path, eval_path=str(other))
    assert len(separate.train_tasks) == 20 and prompts(separate.held_out()) == {"9 + 9"}


def test_the_same_seed_draws_the_same_tasks(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a, b = env(path), env(path)
    assert tasks(a, 6, seed=3) == tasks(b, 6, seed=3) == tasks(a, 6, seed=3)
    assert tasks(a, 6, seed=3) != tasks(a, 6, seed=4)
    batch = [o.prompt for o in a.reset(18, seed=5)]
    assert len(set(batch)) == 18  # distinct while the split lasts
    longer = [o.prompt for o in a.reset(40, seed=5)]
    assert len(longer) == 40 and set(longer) == set(batch)  # then further shuffled passes
    grouped = a.reset(3, seed=2, group_size=2)
    assert [o.prompt for o in grouped[::2]] == [o.prompt for o in grouped[1::2]]


def test_the_environment_keeps_the_contract(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    check_environment("dataset", {"path": str(path), "stop": ["</answer>"]}, reward="correctness")


# ---- bad input: one line naming the option and the row ---------------------------------------------------
def test_bad_files_and_rows_are_one_line_each(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert error(good, answer_column="solution") == (
        f"environment.options.answer_column: no column 'solution' in {good}; its columns are question, answer, level"
    )
    assert error(good, template="{question} {hint}").startswith("environment.options.template: no column 'hint'")
    assert error(good, metadata_columns=["source"]).startswith(
        "environment.options.metadata_columns: no column 'source'"
    )
    assert error(tmp_path / "nope.jsonl") == (
        f"environment.options.path: '{tmp_path / 'nope.jsonl'}' does "
        "not exist (a local file or folder; nothing is downloaded)"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert error(empty) == f"environment.options.path: {empty} holds no rows"
    header_only = tmp_path / "h.csv"
    header_only.write_text("question,answer\n")
    assert error(header_only) == f"environment.options.path: {header_only} holds no rows"
    broken = tmp_path / "x.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:16]) + '{"question": "1 + 1", "answer": \n')
    assert error(broken).startswith(f"environment.options.path: {broken} line 17: not valid JSON (")
    not_object = write_jsonl(tmp_path / "list.jsonl", [[1, 2]])  # type: ignore[list-item]
    assert error(not_object) == f"environment.options.path: {not_object} line 1: expected a JSON object, got list"
    blank = write_jsonl(tmp_path / "blank.jsonl", [*ROWS[:16], {"question": "1 + 1", "answer": " "}])
    assert error(blank) == f"environment.options.path: {blank} line 17: answer ('answer') is empty"
    missing = write_jsonl(tmp_path / "missing.jsonl", [*ROWS[:3], {"question": "1 + 1"}])
    assert error(missing) == f"environment.options.path: {missing} line 4: has no 'answer' (its keys: question)"
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("question,answer\n1 + 1,2\n2 + 2,4,extra\n")
    assert error(ragged) == f"environment.options.path: {ragged} line 3: has more fields than the header's 2"
    short = tmp_path / "short.csv"
    short.write_text("question,answer\n1 + 1\n")
    assert error(short) == f"environment.options.path: {short} line 2: has fewer fields than the header's 2"
    odd = tmp_path / "data.xml"
    odd.write_text("<a/>")
    assert error(odd).startswith(f"environment.options.path: cannot tell the format of '{odd}' from its extension")
    assert (
        error(good, eval_size=20)
        == f"environment.options.eval_size: holds out 20 of the 20 rows of {good}, leaving none to train on"
    )


def test_bad_options_are_one_line_each(tmp_path: Path) -> None:
    good = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    cases = {
        "environment.options.path: required": ["environment.name=dataset"],
        "environment.options.template: set template or messages_column, not both": [
            "environment.name=dataset",
            f"environment.options.path={good}",
            "environment.options.template=What is {question}?",
            "environment.options.messages_column=m",
        ],
        "environment.options.template: fields must be plain column names": [
            "environment.name=dataset",
            f"environment.options.path={good}",
            "environment.options.template=What is {a.b}?",
        ],
        "environment.options.metadata_columns: 'answer' is a metadata key": [
            "environment.name=dataset",
            f"environment.options.path={good}",
            "environment.options.metadata_columns=[answer]",
        ],
        "environment.options.eval_fraction: must be < 1": [
            "environment.name=dataset",
            f"environment.options.path={good}",
            "environment.options.eval_fraction=1",
        ],
    }
    for start, overrides in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert str(info.value).startswith(start), str(info.value)


def test_a_parquet_file_with_a_missing_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "1 + 1", "answer": 2}]).to_parquet(str(path))
    assert (
        error(path)
        == f"environment.options.prompt_column: no column 'question' in {path}; its columns are prompt, answer"
    )
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    assert error(junk).startswith(f"environment.options.path: {junk}: cannot read it as Parquet: ")
    folder = tmp_path / "plain_folder"
    folder.mkdir()
    assert error(folder).startswith(
        f"environment.options.path: {folder}: not a folder written by datasets' save_to_disk: "
    )


# ---- a real run ---------------------------------------------------------------------------------------------
def test_two_training_steps_on_the_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the example's path is relative to the repository root
    out = tmp_path / "runs"
    code = cli.main(["train", "--config", "examples/dataset_math.yaml", "train.steps=2", "train.batch_size=4",
                     "train.group_size=2", "train.eval_size=4", f"run.output_dir={out}"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "trained 2 steps in " in captured.out and "held-out reward on 4 tasks" in captured.out
    metrics = [json.loads(line) for line in (out / "dataset_math" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]


def test_the_example_data_file_is_what_its_script_writes() -> None:
    import runpy

    script = runpy.run_path(str(REPO / "examples" / "data" / "make_sums.py"))
    for name, made in (("sums.jsonl", script["rows"]), ("sums_chat.jsonl", script["chat_rows"])):
        written = [json.loads(line) for line in (REPO / "examples" / "data" / name).read_text().splitlines()]
        assert written == made(), name


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_path_that_is_not_a_regular_file_is_refused_instead_of_read_forever(kind: str, tmp_path: Path) -> None:
    # /dev/zero never ends and a FIFO with no writer never starts: both used to hang with no message (issue 23)
    if kind == "device":
        path = "/dev/zero"
    else:
        path = str(tmp_path / "rows.jsonl")
        os.mkfifo(path)
    assert error(path, format="jsonl") == (
        f"environment.options.path: {path!r} is not a regular file (a device, a FIFO or a socket); "
        "name a .jsonl, .csv or .parquet file, or a datasets.save_to_disk folder"
    )
