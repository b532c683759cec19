"""Built-in environment ``dataset``: one question and one answer per episode, read from a local data file.

``path`` names a JSONL file (one JSON object per line), a CSV file (a header row, then one row per task), a
Parquet file, or a folder written by ``datasets.Dataset.save_to_disk`` (``datasets.load_from_disk``); the format
comes from the extension (``.jsonl``/``.ndjson``, ``.csv``, ``.parquet``) or from the path being a folder, or from
``format``. JSONL and CSV need nothing beyond the standard library; Parquet and folders need ``pyarrow`` /
``datasets`` (``pip install "palestra[datasets]"``), imported only when such a file is read. Nothing is downloaded.

**Columns.** The prompt is ``prompt_column`` (text), or ``template`` formatted over the row's columns
(``"Q: {question}"``), or ``messages_column`` (a list of ``{role, content}`` chat messages); ``system_prompt`` adds a
system message in front. ``answer_column`` becomes ``metadata["answer"]`` (what the ``correctness`` reward reads),
and ``metadata_columns`` are copied into the metadata under their own names. ``metadata["row"]`` is the task's
place in its file (0-based), for tracing a score back to the data.

**Held-out split.** ``eval_fraction`` (or ``eval_size`` rows) of the file, chosen by ``split_seed``, is held out:
``split: train`` (the default) never draws those rows and ``split: eval`` draws only them; with ``eval_path`` the
whole of that second file is the held-out split and all of ``path`` is training data. :meth:`DatasetEnv.held_out`
is the same environment over the held-out rows. With nothing held out (``eval_fraction: 0``), ``split: eval`` draws
the training rows.

**Determinism.** ``reset(n, seed=s)`` draws ``n`` distinct rows (a fresh shuffled pass each time the split runs out)
from ``random.Random(s)``, so the tasks depend on the seed alone; the trainer's seeds come from the run seed.

**Errors** are one line naming the option and, for a bad row, the file and the row: ``environment.options.path:
examples/data/x.jsonl line 17: not valid JSON (...)``, ``environment.options.answer_column: no column 'ans' in
data.csv; its columns are question, answer``.
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import ConfigError, OptionError, check_options, format_fields, option
from palestra.plugins.envs._episodes import single_turn_step
from palestra.registry import MissingDependency
from palestra.types import Message, Observation, StepResult

WHERE = "environment.options"  # where the options sit in a config; errors name keys below it
INSTALL_HINT = 'pip install "palestra[datasets]"'
FORMATS = ("jsonl", "csv", "parquet", "disk")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
RESERVED_METADATA = ("answer", "row")


@dataclass
class DatasetOptions:
    path: str = option("", path="cwd")  # a .jsonl, .csv or .parquet file, or a datasets.save_to_disk folder (required)
    format: Literal["auto", "jsonl", "csv", "parquet", "disk"] = "auto"  # auto: from the extension (a folder: disk)
    data_split: str = "train"  # a folder holding a DatasetDict: which of its splits to read
    prompt_column: str = "question"  # the prompt text (unless template or messages_column is given)
    template: str | None = None  # instead: a format string over the columns, e.g. "What is {question}?"
    messages_column: str | None = None  # instead: a column of chat messages [{role, content}, ...]
    system_prompt: str | None = None  # a system message put in front of every prompt
    answer_column: str = "answer"  # the expected answer, as metadata["answer"]
    metadata_columns: list[str] = field(default_factory=list)  # more columns copied into the metadata
    eval_fraction: float = option(
        0.1, ge=0, lt=1
    )  # the share of path's rows held out (when eval_size and eval_path are not set)
    eval_size: int | None = option(None, ge=0)  # instead: this many rows held out
    eval_path: str | None = option(
        None, path="cwd"
    )  # instead: this file (same format rules) is the held-out split; path is all training
    split_seed: int = 0  # which rows are held out (the same for every run seed, so runs compare on the same rows)
    split: Literal["train", "eval"] = "train"  # which rows reset() draws
    stop: list[str] = field(default_factory=list)  # stop strings for every completion, e.g. ["</answer>"]
    agent_id: str = "assistant"

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise OptionError(
                "path", "required: a local .jsonl, .csv or .parquet file, or a datasets.save_to_disk folder"
            )
        if self.template is not None and self.messages_column is not None:
            raise OptionError("template", "set template or messages_column, not both")
        if self.template is not None:
            template_fields(self.template)
        if self.eval_size is not None and self.eval_path is not None:
            raise OptionError("eval_size", "set eval_size or eval_path, not both")
        for name in self.metadata_columns:
            if name in RESERVED_METADATA:
                raise OptionError(
                    "metadata_columns",
                    f"{name!r} is a metadata key the environment sets itself ({', '.join(RESERVED_METADATA)})",
                )
        if any(not s for s in self.stop):
            raise OptionError("stop", "stop strings must not be empty")


def template_fields(template: str) -> list[str]:
    """The column names a template uses; a one-line :class:`OptionError` for anything but plain ``{name}`` fields."""
    names = format_fields("template", template)
    for name in names:
        if not name.isidentifier():
            raise OptionError("template", f"fields must be plain column names such as {{question}}, got {{{name}}}")
    if not names:
        raise OptionError("template", "uses no column; write e.g. 'What is {question}?'")
    return names


@dataclass(frozen=True)
class Task:
    row: int  # its place in its file
    prompt: str
    messages: tuple[Message, ...]
    answer: str
    metadata: tuple[tuple[str, Any], ...]  # the metadata_columns, in order


# ---- reading files -----------------------------------------------------------------------------------
@dataclass
class RawRow:
    where: str  # "line 17" or "row 17" (1-based), for error messages
    values: dict[str, Any]


def detect_format(path: Path, fmt: str, key: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "disk"
    found = _EXTENSIONS.get(path.suffix.lower())
    if found is None:
        raise ConfigError(
            f"{WHERE}.{key}: cannot tell the format of {str(path)!r} from its extension; use .jsonl, .csv or .parquet "
            f"(or a datasets.save_to_disk folder), or set {WHERE}.format"
        )
    return found


def read_rows(path_text: str, fmt: str, data_split: str, key: str) -> tuple[list[RawRow], list[str]]:
    """Every row of the file (in order) and its column names; a one-line :class:`ConfigError` naming ``key``."""
    path = Path(path_text).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{WHERE}.{key}: {path_text!r} does not exist (a local file or folder; nothing is downloaded)"
        )
    if not path.is_dir() and not path.is_file():  # reading a device or a FIFO would never end (or never start)
        raise ConfigError(
            f"{WHERE}.{key}: {path_text!r} is not a regular file (a device, a FIFO or a socket); "
            "name a .jsonl, .csv or .parquet file, or a datasets.save_to_disk folder"
        )
    fmt = detect_format(path, fmt, key)
    if fmt != "disk" and path.is_dir():
        raise ConfigError(f"{WHERE}.{key}: {path_text!r} is a folder, but format is {fmt}")
    if fmt == "disk" and not path.is_dir():
        raise ConfigError(
            f"{WHERE}.{key}: {path_text!r} is not a folder; format disk reads a datasets.save_to_disk folder"
        )
    reader = {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet, "disk": _read_disk}[fmt]
    rows, columns = reader(path, path_text, key, data_split)
    if not rows:
        raise ConfigError(f"{WHERE}.{key}: {path_text} holds no rows")
    return rows, columns


def _read_jsonl(path: Path, shown: str, key: str, data_split: str) -> tuple[list[RawRow], list[str]]:
    rows: list[RawRow] = []
    columns: dict[str, None] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(_lines(f, shown, key), start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{WHERE}.{key}: {shown} line {number}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{WHERE}.{key}: {shown} line {number}: expected a JSON object, got {type(value).__name__}"
                )
            columns.update(dict.fromkeys(value))
            rows.append(RawRow(f"line {number}", value))
    return rows, list(columns)


def _lines(f: Any, shown: str, key: str) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ConfigError(f"{WHERE}.{key}: {shown} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_csv(path: Path, shown: str, key: str, data_split: str) -> tuple[list[RawRow], list[str]]:
    rows: list[RawRow] = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(_lines(f, shown, key))
        try:
            header = list(reader.fieldnames or [])
            for values in reader:
                where = f"line {reader.line_num}"
                if None in values:
                    raise ConfigError(
                        f"{WHERE}.{key}: {shown} {where}: has more fields than the header's {len(header)}"
                    )
                if any(v is None for v in values.values()):
                    raise ConfigError(
                        f"{WHERE}.{key}: {shown} {where}: has fewer fields than the header's {len(header)}"
                    )
                rows.append(RawRow(where, dict(values)))
        except csv.Error as e:
            raise ConfigError(f"{WHERE}.{key}: {shown} line {reader.line_num}: not valid CSV ({e})") from None
    if len(set(header)) != len(header):
        repeated = sorted({c for c in header if header.count(c) > 1})
        raise ConfigError(f"{WHERE}.{key}: {shown}: the header repeats the column(s) {', '.join(repeated)}")
    return rows, header


def _read_parquet(path: Path, shown: str, key: str, data_split: str) -> tuple[list[RawRow], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingDependency(f"{WHERE}.{key}: reading Parquet", "pyarrow", INSTALL_HINT, cause=e) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for a damaged or foreign file
        raise ConfigError(f"{WHERE}.{key}: {shown}: cannot read it as Parquet: {_first_line(e)}") from None
    return [RawRow(f"row {i + 1}", values) for i, values in enumerate(table.to_pylist())], list(table.column_names)


def _read_disk(path: Path, shown: str, key: str, data_split: str) -> tuple[list[RawRow], list[str]]:
    try:
        import datasets
    except ImportError as e:
        raise MissingDependency(
            f"{WHERE}.{key}: reading a saved dataset folder", "datasets", INSTALL_HINT, cause=e
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError for a folder it did not write, and others
        raise ConfigError(
            f"{WHERE}.{key}: {shown}: not a folder written by datasets' save_to_disk: {_first_line(e)}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if data_split not in loaded:
            raise ConfigError(
                f"{WHERE}.data_split: {shown} has no split {data_split!r}; its splits are {', '.join(loaded)}"
            )
        loaded = loaded[data_split]
    return [RawRow(f"row {i + 1}", values) for i, values in enumerate(loaded.to_list())], list(loaded.column_names)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---- rows to tasks -----------------------------------------------------------------------------------
def make_tasks(options: DatasetOptions, rows: Sequence[RawRow], columns: Sequence[str], shown: str) -> list[Task]:
    """Check the column options against the file's columns, then turn every row into a :class:`Task`."""
    o = options
    needed: list[tuple[str, str]] = [("answer_column", o.answer_column)]
    if o.messages_column is not None:
        needed.append(("messages_column", o.messages_column))
    elif o.template is not None:
        needed += [("template", name) for name in template_fields(o.template)]
    else:
        needed.append(("prompt_column", o.prompt_column))
    needed += [("metadata_columns", name) for name in o.metadata_columns]
    for key, column in needed:
        if column not in columns:
            raise ConfigError(
                f"{WHERE}.{key}: no column {column!r} in {shown}; its columns are {', '.join(map(str, columns))}"
            )
    return [_task(o, i, raw, shown) for i, raw in enumerate(rows)]


def _task(o: DatasetOptions, index: int, raw: RawRow, shown: str) -> Task:
    def bad(message: str) -> ConfigError:
        return ConfigError(f"{WHERE}.path: {shown} {raw.where}: {message}")

    values = raw.values

    def column(name: str) -> Any:
        if name not in values:
            raise bad(f"has no {name!r} (its keys: {', '.join(values)})")
        return values[name]

    answer = column(o.answer_column)
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise bad(f"answer ({o.answer_column!r}) is empty")
    if isinstance(answer, (dict, list)):
        raise bad(f"answer ({o.answer_column!r}) must be a string or a number, got {type(answer).__name__}")
    system = [Message("system", o.system_prompt)] if o.system_prompt else []
    if o.messages_column is not None:
        chat = [*system, *_messages(column(o.messages_column), o.messages_column, bad)]
        prompt = "\n".join(f"{m.role}: {m.content}" for m in chat)
    else:
        if o.template is not None:
            text = o.template.format(**{name: _text(column(name)) for name in template_fields(o.template)})
        else:
            value = column(o.prompt_column)
            if not isinstance(value, str):
                raise bad(f"prompt ({o.prompt_column!r}) must be text, got {type(value).__name__}")
            text = value
        if not text.strip():
            raise bad(
                "the template gives an empty prompt"
                if o.template is not None
                else f"prompt ({o.prompt_column!r}) is empty"
            )
        chat = [*system, Message("user", text)]
        prompt = f"{o.system_prompt}\n\n{text}" if o.system_prompt else text
    meta = tuple((name, column(name)) for name in o.metadata_columns)
    return Task(index, prompt, tuple(chat), _text(answer), meta)


def _messages(value: Any, name: str, bad: Any) -> list[Message]:
    if isinstance(value, str):  # CSV cells hold text: a JSON list is accepted there
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise bad(
                f"messages ({name!r}) must be a list of {{role, content}} messages (or its JSON), got text"
            ) from None
    if not isinstance(value, list) or not value:
        raise bad(
            f"messages ({name!r}) must be a non-empty list of {{role, content}} messages, got {type(value).__name__}"
        )
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise bad(f"messages ({name!r}) item {i} must be {{role: str, content: str}}, got {m!r:.80}")
        out.append(Message(m["role"], m["content"]))
    return out


def _text(value: Any) -> str:
    """A cell as text: strings as they are, lists and objects as JSON, anything else by ``str`` (3 -> "3")."""
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def held_out_rows(n: int, options: DatasetOptions) -> list[int]:
    """The sorted row indices of ``path`` that are held out (none with eval_path: that file is the held-out split)."""
    o = options
    if o.eval_path is not None:
        return []
    k = o.eval_size if o.eval_size is not None else round(n * o.eval_fraction)
    if o.eval_size is None and o.eval_fraction > 0:
        k = max(k, 1)
    if k >= n:
        key = "eval_size" if o.eval_size is not None else "eval_fraction"
        raise ConfigError(f"{WHERE}.{key}: holds out {k} of the {n} rows of {o.path}, leaving none to train on")
    order = list(range(n))
    random.Random(o.split_seed).shuffle(order)
    return sorted(order[:k])


def draw(pool: Sequence[Task], n: int, rng: random.Random) -> list[Task]:
    """``n`` tasks from ``pool``: distinct while the pool lasts, then another shuffled pass."""
    out: list[Task] = []
    while len(out) < n:
        take = min(n - len(out), len(pool))
        out += rng.sample(list(pool), take)
    return out


# ---- the environment ---------------------------------------------------------------------------------
class DatasetEnv:
    """Questions from a data file, one per episode. See the module docstring and :class:`palestra.types.Environment`."""

    max_turns = 1

    def __init__(self, **options: Any) -> None:
        self.options: DatasetOptions = check_options(DatasetOptions, options, where="dataset")
        o = self.options
        self.agent_ids = (o.agent_id,)
        rows, columns = read_rows(o.path, o.format, o.data_split, "path")
        tasks = make_tasks(o, rows, columns, o.path)
        if o.eval_path is not None:
            eval_rows, eval_columns = read_rows(o.eval_path, o.format, o.data_split, "eval_path")
            self.train_tasks, self.eval_tasks = tasks, make_tasks(o, eval_rows, eval_columns, o.eval_path)
        else:
            held = set(held_out_rows(len(tasks), o))
            self.train_tasks = [t for t in tasks if t.row not in held]
            self.eval_tasks = [t for t in tasks if t.row in held]
        self.pool = self.train_tasks if o.split == "train" or not self.eval_tasks else self.eval_tasks
        self._rng = random.Random()
        self._tasks: list[Task] = []
        self._live: list[bool] = []

    def held_out(self) -> DatasetEnv:
        """The same environment over the held-out rows (``split: eval``); training never draws them."""
        return DatasetEnv(**{**asdict(self.options), "split": "eval"})

    def observation(self, task: Task) -> Observation:
        o = self.options
        return Observation(
            prompt=task.prompt,
            agent_id=o.agent_id,
            messages=list(task.messages),
            metadata={"answer": task.answer, "row": task.row, **dict(task.metadata)},
            stop=list(o.stop) or None,
        )

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        for name, value in (("batch_size", batch_size), ("group_size", group_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dataset.reset: {name} must be a positive integer, got {value!r}")
        source = random.Random(seed) if seed is not None else self._rng
        self._tasks = [t for t in draw(self.pool, batch_size, source) for _ in range(group_size)]
        self._live = [True] * len(self._tasks)
        return [self.observation(t) for t in self._tasks]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        expected = [t.answer for t in self._tasks]
        result = single_turn_step("dataset", actions, self._live, self.options.agent_id, expected)
        self._live = [False] * len(self._tasks)
        return result


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "dataset",
        DatasetEnv,
        options=DatasetOptions,
        description=(
            "questions and answers from a local JSONL, CSV, Parquet file or datasets folder, with a held-out split"
        ),
    )
