"""The shape issue 22 set for the code: no class in core/ over 400 lines, no function over 80 lines in core/ or the
hf policy (plugins/policies/hf.py and the model classes it loads). A long class or function is a second program."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CLASS, MAX_FUNCTION = 400, 80


def sources() -> list[Path]:
    policies = ROOT / "plugins" / "policies"
    return [*sorted((ROOT / "core").rglob("*.py")), policies / "hf.py", policies / "_hf_model.py"]


def too_long(paths: list[Path], root: Path = ROOT) -> list[str]:
    """A line for every class over the limit in ``root/core`` and every function over it anywhere in ``paths``."""
    found = []
    for path in paths:
        name = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                if lines > MAX_CLASS and path.is_relative_to(root / "core"):
                    found.append(f"class {name}:{node.lineno} {node.name}: {lines} lines")
            elif lines > MAX_FUNCTION:
                found.append(f"function {name}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_class_over_400_lines_and_no_function_over_80() -> None:
    assert all(p.exists() for p in sources())
    assert too_long(sources()) == []


def test_the_check_names_a_long_function_and_a_long_class(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_CLASS))
    (tmp_path / "core" / "probe.py").write_text(f"class Big:\n    def long(self):\n{body}\n")
    attributes = "\n".join(f"    y{i} = {i}" for i in range(MAX_CLASS))
    (tmp_path / "plugin.py").write_text(f"class Long:\n{attributes}\n")  # a long class outside core/ is allowed
    assert too_long([tmp_path / "core" / "probe.py", tmp_path / "plugin.py"], tmp_path) == [
        f"class core/probe.py:1 Big: {MAX_CLASS + 2} lines",
        f"function core/probe.py:2 long: {MAX_CLASS + 1} lines",
    ]
