"""The driver names worker methods, not strings: every group call goes through WorkerApi, and what
answers it (the Ray actor's class, the fake group) has each method with the same parameters."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from elastictrain.cluster.worker_api import WorkerApi, driver_methods, method_name
from elastictrain.testing.fake_group import FakeGroup

ROOT = Path(__file__).resolve().parents[2]


def _parameters(fn: object, skip: int) -> list[str]:
    # Ray adds `_ray_trace_ctx` to an actor class's methods once the class has been made remote.
    names = list(inspect.signature(fn).parameters)[skip:]  # type: ignore[arg-type]
    return [n for n in names if n != "_ray_trace_ctx"]


def test_a_group_call_that_names_a_method_by_string_is_refused() -> None:
    group = FakeGroup(2)
    with pytest.raises(TypeError, match="WorkerApi method"):
        group.call(group.workers, "train_step", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WorkerApi method"):
        method_name(FakeGroup.call)


def test_no_call_in_the_code_tests_or_benchmarks_names_a_worker_method_by_string() -> None:
    found = []
    for folder in ("src", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("call", "call_each")
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                    and path.name != Path(__file__).name
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[1].value!r}")
    assert not found, "name the WorkerApi method instead: " + ", ".join(found)


def test_the_ray_actor_answers_every_method_the_driver_may_call_with_the_same_parameters() -> None:
    from elastictrain.worker.actor import TrainWorker

    for name in driver_methods():
        assert hasattr(TrainWorker, name), f"TrainWorker lacks WorkerApi.{name}"
        assert _parameters(getattr(TrainWorker, name), 1) == _parameters(getattr(WorkerApi, name), 1), name


def test_the_fake_group_answers_every_method_it_models_with_the_same_parameters() -> None:
    modelled = [n for n in driver_methods() if n not in FakeGroup.NOT_MODELLED]
    assert set(FakeGroup.NOT_MODELLED) <= set(driver_methods())
    for name in modelled:
        fake = getattr(FakeGroup, f"_{name}", None)
        assert fake is not None, f"FakeGroup lacks _{name} (or list it in NOT_MODELLED with why)"
        assert _parameters(fake, 2) == _parameters(getattr(WorkerApi, name), 1), name


def test_the_fake_refuses_a_method_it_does_not_model_by_name() -> None:
    group = FakeGroup(1)
    name = next(iter(FakeGroup.NOT_MODELLED))
    with pytest.raises(NotImplementedError, match=name):
        group.call(group.workers, getattr(WorkerApi, name))


def test_fault_injection_lives_only_on_the_testing_subclass_of_the_worker() -> None:
    from elastictrain.testing.faulty_worker import FaultyTrainWorker
    from elastictrain.worker.actor import TrainWorker

    assert [n for n in dir(TrainWorker) if n.startswith("inject_")] == []
    injected = sorted(n for n in dir(FaultyTrainWorker) if n.startswith("inject_"))
    assert injected == ["inject_fault", "inject_forward_delay", "inject_snapshot_delay", "inject_write_delay"]
