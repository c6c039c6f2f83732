"""Nothing outside elastictrain/compat/ names a private attribute of DeepSpeed, torch.distributed,
transformers, MLflow, peft or py-cpuinfo, nor assigns into one of their modules or classes.

Read from the source with `ast`: an attribute starting with `_` that elastictrain does not define
itself, a private module or name imported from those packages, a private name given as a string to
getattr/hasattr/setattr, a name-mangled string, and an assignment or `setattr`/`mock.patch.object` into
a module or class imported from them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "elastictrain"
FOREIGN = ("deepspeed", "transformers", "mlflow", "peft", "cpuinfo", "torch.distributed")
STDLIB_PRIVATE = {
    "_current_frames",
    "_exit",
    "_asdict",
    "_replace",
    "_fields",
    "_make",
}  # sys, os, namedtuple
MANGLED = re.compile(r"^_[A-Za-z]\w*__\w+$")


def _is_foreign(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FOREIGN)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_names(trees: list[ast.AST]) -> set[str]:
    """Every name elastictrain defines: functions, classes, module and class attributes, `self._x`."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def _foreign_bindings(tree: ast.AST) -> set[str]:
    """Local names bound to a module or object imported from a foreign package."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_foreign(alias.name):
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and _is_foreign(node.module):
            bound.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            bound.update(alias.asname or alias.name for alias in node.names if alias.name == "distributed")
    return bound


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str, own: set[str]) -> list[str]:
    """What `source` reaches into: `line: text` for each private use of a foreign package."""
    tree = ast.parse(source)
    foreign = _foreign_bindings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _is_foreign(node.module):
            parts = node.module.split(".")
            if any(_private(p) for p in parts) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _is_foreign(a.name)
                      and any(_private(p) for p in a.name.split("."))]  # fmt: skip
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if (
                node.attr not in own
                and node.attr not in STDLIB_PRIVATE
                and not node.attr.startswith("_elastictrain")
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MANGLED.match(node.value):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            args = node.args
            key = args[1] if name in ("getattr", "hasattr", "setattr", "delattr") and len(args) >= 2 else None
            text = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else ""
            if _private(text) and text not in own and not text.startswith("_elastictrain"):
                found.append((node.lineno, ast.unparse(node)))
            if (
                name in ("setattr", "mock.patch.object", "patch.object")
                and args
                and _root(args[0]) in foreign
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _root(target) in foreign:
                    found.append((node.lineno, f"{ast.unparse(target)} = ..."))
    return [f"{line}: {text}" for line, text in sorted(set(found))]


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_nothing_outside_compat_touches_a_private_name_of_deepspeed_torch_distributed_transformers_mlflow():
    sources = _sources()
    own = own_names([ast.parse(s) for s in sources.values()])
    outside = {
        str(path.relative_to(PACKAGE)): uses
        for path, source in sources.items()
        if path.relative_to(PACKAGE).parts[0] != "compat" and (uses := private_uses(source, own))
    }
    assert outside == {}, f"private names of DeepSpeed & co outside elastictrain/compat/: {outside}"


def test_the_grep_sees_each_kind_of_private_use():
    # Guards the guard: each line below is one of the uses it must catch.
    sample = (
        "import torch.distributed as dist\n"
        "from deepspeed.runtime.zero.partition_parameters import Init\n"
        "from mlflow.tracking._tracking_service import utils\n"
        "from unittest import mock\n"
        "def f(opt, engine):\n"
        "    opt._swappable_optimizer_subgroup(0)\n"
        "    dist.distributed_c10d._abort_process_group()\n"
        "    getattr(opt, '_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition')\n"
        "    hasattr(opt, '_hp_optimizer_states_linked')\n"
        "    Init.param_id = 0\n"
        "    mock.patch.object(Init, 'partition', None)\n"
    )
    uses = private_uses(sample, own_names([]))
    assert [u.split(":")[0] for u in uses] == ["3", "6", "7", "8", "8", "9", "10", "11"], uses


def test_the_grep_leaves_elastictrains_own_private_names_alone():
    sample = (
        "class Worker:\n"
        "    def _train_step(self):\n"
        "        self._mark = 1\n"
        "def run(worker):\n"
        "    import sys\n"
        "    worker._train_step(); worker._mark; sys._current_frames()\n"
    )
    source_own = own_names([ast.parse(sample)])
    assert private_uses(sample, source_own) == []
