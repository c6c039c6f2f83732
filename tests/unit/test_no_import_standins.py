"""No module of elastictrain puts a stand-in into `sys.modules` (issue 59): a module that answers an
import in another's place, or None that makes an import fail, changes what other libraries see to save
seconds of an import, and breaks on their next release. The source is read, not run."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# The mutating methods of the dict `sys.modules`.
MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _names_of_sys(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names `sys` is bound to (`import sys`, `import sys as s`) and those bound to `sys.modules`
    itself (`from sys import modules`)."""
    sys_names, modules_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            sys_names |= {a.asname or a.name for a in node.names if a.name == "sys"}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            modules_names |= {a.asname or a.name for a in node.names if a.name == "modules"}
    return sys_names, modules_names


def module_table_writes(source: str) -> list[int]:
    """The lines of `source` that assign, delete or update an entry of `sys.modules`."""
    tree = ast.parse(source)
    sys_names, modules_names = _names_of_sys(tree)

    def is_modules(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "modules":
            return isinstance(node.value, ast.Name) and node.value.id in sys_names
        return isinstance(node, ast.Name) and node.id in modules_names

    def is_entry(node: ast.AST) -> bool:
        return isinstance(node, ast.Subscript) and is_modules(node.value)

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]  # `a = sys.modules[x] = m`
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value] if node.func.attr in MUTATORS else []
        if any(is_entry(t) or (isinstance(node, ast.Call) and is_modules(t)) for t in targets):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_of_elastictrain_writes_into_sys_modules() -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        for line in module_table_writes(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"sys.modules written at {offenders}: import the real module, or leave it lazy"


def test_the_scan_finds_each_shape_of_the_stand_ins_that_were_removed() -> None:
    old = (
        "import sys\n"
        "from sys import modules as table\n"
        "sys.modules['mlflow'] = None\n"  # compat/deepspeed/imports.py made `import mlflow` fail
        "sys.modules.update(stand_ins)\n"  # compat/transformers/deferred_imports.py: scipy, boto3
        "del sys.modules[name]\n"
        "table['boto3'] = object()\n"
    )
    assert module_table_writes(old) == [3, 4, 5, 6]
    reads = "import sys\nloaded = sys.modules.get('transformers')\nok = 'torch' in sys.modules\n"
    assert module_table_writes(reads) == []
