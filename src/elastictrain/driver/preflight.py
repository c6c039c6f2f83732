"""Checks made before a run folder or an actor exists, so a bad input fails at once and clearly."""

from __future__ import annotations

import os
import socket
from typing import Any

from elastictrain.cluster.nodes import on_each_node, worker_nodes
from elastictrain.user_code import (
    FIELDS,
    UserCodeError,
    resolve,
    user_callable,
    user_dataset,
    user_model,
)


class PreflightError(Exception):
    """A problem found before starting; the message names the input and what would be valid."""


def check_ray_address(target: str | None, timeout_s: float = 5.0) -> None:
    """Fail now when nothing listens at a Ray address (ray.init would retry for minutes)."""
    if not target or target in ("auto", "local"):
        return
    where = target.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if "://" in where or not sep or not host or not port.isdigit():
        raise PreflightError(
            f"Ray address {target!r}: expected host:port of a Ray head (e.g. 10.0.0.5:6379), "
            "ray://host:10001 for Ray Client, or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise PreflightError(
            f"Ray address {target}: no Ray cluster answers there ({reason}). Start one with "
            f"`ray start --head --port={port}`, give the host:port of a running head (--address, ray.address "
            "or RAY_ADDRESS), or set none of them to start a local cluster"
        ) from None


# -- user code, tried on the driver ------------------------------------------------------------------------
def check_user_code(config: Any) -> None:
    """Resolve every user-code field and try the factories, before any worker starts.

    First the model's transformers config is built here (config/model_check.py): a config error
    (ConfigError) naming the field instead of a failure inside every worker.

    The model factory is called under torch.device("meta"), so checking it allocates no weights. The
    dataset is built for real (its length is needed), and its first item collated.
    """
    from elastictrain.config import ConfigError
    from elastictrain.config.model_check import model_problems, vocab_problem

    problems = model_problems(config)
    if problems:
        raise ConfigError(problems)
    for field in FIELDS:
        user_callable(config, field) if field in ("data.collate", "training.loss") else resolve(config, field)
    if config.model.factory is not None:
        import torch  # only here: a transformers model's check may need no torch (config/model_check.py)

        with torch.device("meta"):
            model = user_model(config)
        try:
            rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
        except Exception:  # noqa: BLE001 - not a transformers-style model: nothing to compare
            rows = None
        problem = vocab_problem(config, rows, "model.factory's input embedding rows")
        if problem:
            raise ConfigError([problem])
        if config.eval.prompts is not None and not callable(getattr(model, "generate", None)):
            raise UserCodeError(
                f"eval.prompts: set, but the model of model.factory {config.model.factory!r} "
                f"({type(model).__name__}) has no generate(); completions need a transformers causal LM "
                "(a PreTrainedModel); remove eval.prompts, or return a transformers model from the factory"
            )
        if config.deepspeed.activation_checkpointing and not hasattr(model, "gradient_checkpointing_enable"):
            raise UserCodeError(
                f"deepspeed.activation_checkpointing: true, but the model of model.factory "
                f"{config.model.factory!r} has no gradient_checkpointing_enable(); set it to false and "
                "checkpoint inside your module (torch.utils.checkpoint)"
            )
    if config.model.lora.enabled:
        check_targets(config)
    if config.data.source == "hf":
        from elastictrain.data.hf_files import check_hf_data

        try:
            check_hf_data(config.data)
        except ValueError as e:
            raise UserCodeError(str(e)) from e
    check_sft_records(config)
    if config.data.source == "factory":
        from elastictrain.data.sources import collate_items

        dataset = user_dataset(config)
        collate = user_callable(config, "data.collate")
        try:
            collate_items([dataset[0]], collate)
        except Exception as e:  # noqa: BLE001 - reported with the fields involved
            raise UserCodeError(
                f"data.factory: collating item 0 of {config.data.factory!r} with "
                f"{'data.collate ' + repr(config.data.collate) if collate else 'the default collate'} "
                f"failed: {type(e).__name__}: {e}"
            ) from e


def check_sft_records(config: Any) -> None:
    """Instruction records (data.source sft, for training and eval.data) built here once: bad records are
    named and the run refused (unless data.on_bad_record is skip), the template checked on every record."""
    import re

    for prefix, data in (("data", config.data), ("eval.data", config.eval.data)):
        if data is None or data.source != "sft" or (prefix == "eval.data" and data == config.data):
            continue
        from elastictrain.data.preference.build import PreferenceDataError, build_kto, build_pairs
        from elastictrain.data.sft.dataset import SftDataError, build_sft_dataset  # imports torch

        objective = config.training.objective
        build = build_sft_dataset if objective == "lm" else build_kto if objective == "kto" else build_pairs
        try:
            build(data, config.model.pretrained)
        except (SftDataError, PreferenceDataError) as e:
            # Each line opens with the field (data.x: ...); file names further on stay as they are.
            raise UserCodeError(re.sub(r"(?m)^data([.:])", prefix + r"\1", str(e))) from e


def check_targets(config: Any) -> None:
    """On the driver, before workers start: every LoRA target names modules of the model (built empty)."""
    from elastictrain.model.build import forget_hf_deepspeed_config
    from elastictrain.model.empty import empty_weights
    from elastictrain.model.lora import _check_targets
    from elastictrain.tools.adapter import base_structure

    forget_hf_deepspeed_config()
    with empty_weights():
        model = base_structure(config)
    try:
        _check_targets(model, config.model.lora)
    except ValueError as e:
        raise UserCodeError(str(e)) from None


# -- deepspeed.nvme_path on the nodes, once connected to Ray -------------------------------------------
def _nvme_probe(path: str) -> tuple[str, str | None]:
    """Runs on one node: its host name, and why `path` is not a folder this user can write (None: it is)."""
    import tempfile

    host = socket.gethostname()
    if not os.path.isdir(path):
        return host, "it does not exist or is not a folder there"
    try:
        with tempfile.TemporaryFile(dir=path):
            return host, None
    except OSError as e:
        return host, f"it cannot be written there ({e.strerror or e})"


def _node_name(node: dict[str, Any]) -> str:
    return f"{node['NodeManagerAddress']} (id {node['NodeID'][:8]})"


def check_nvme_on_nodes(config: Any, timeout_s: float = 60.0) -> int:
    """With an NVMe offload, write a file in deepspeed.nvme_path on every alive node that can host a worker.

    The driver's own check (config/validate.py) sees only the driver's machine; each rank swaps on its
    own node. One task per node. Returns the number of nodes checked; raises PreflightError naming
    every node where the folder is missing or read-only.
    """
    ds = config.deepspeed
    if "nvme" not in (ds.offload_optimizer, ds.offload_param):
        return 0
    nodes = worker_nodes(config)
    if not nodes:
        return 0  # no node can host a worker yet: the run waits for capacity and says so
    answers, late = on_each_node(nodes, _nvme_probe, ds.nvme_path, timeout_s=timeout_s)
    problems = [f"node {_node_name(n)} on {host}: {why}" for n, (host, why) in answers if why]
    problems += [f"node {_node_name(n)}: did not answer within {timeout_s:.0f}s" for n in late]
    if problems:
        raise PreflightError(
            f"deepspeed.nvme_path: got {ds.nvme_path!r}; expected a folder every worker node can write "
            "(each rank swaps there), but:\n" + "\n".join(f"  {p}" for p in sorted(problems))
        )
    return len(nodes)


# -- memory, once connected to Ray -----------------------------------------------------------------------
def node_memory_probe() -> tuple[str, int | None]:
    """Runs on one node: its host name and total memory (MemTotal) in bytes."""
    from elastictrain.host.memory import meminfo_bytes

    return socket.gethostname(), meminfo_bytes("MemTotal")


def model_size(config: Any) -> tuple[list[int], int]:
    """(each parameter's size in order, parameters of the largest layer) of the model, built empty (no
    memory, no download)."""
    sizes, largest, _ = model_parts(config)
    return sizes, largest


def model_parts(config: Any) -> tuple[list[int], int, int]:
    """`model_size`, and the parameters of its linear layers: what tensor parallelism slices (AutoTP
    splits each nn.Linear between a replica's ranks; embeddings and norms stay whole); remembered per
    machine for a `model.hf_config` model (config/model_facts.py)."""
    from elastictrain.config import model_facts

    hf_config, facts = model_facts.recall(config)
    if "parameter_sizes" in facts:
        return list(facts["parameter_sizes"]), int(facts["largest_layer"]), int(facts["linear_parameters"])
    import torch

    from elastictrain.model.build import forget_hf_deepspeed_config
    from elastictrain.model.empty import empty_weights
    from elastictrain.tools.adapter import base_structure

    forget_hf_deepspeed_config()
    with empty_weights():
        model = base_structure(config)
    sizes = [p.numel() for p in model.parameters()]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    linear = {
        id(p): p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
    }
    if hf_config is not None:
        model_facts.remember(
            hf_config, parameter_sizes=sizes, largest_layer=largest, linear_parameters=sum(linear.values())
        )
    return sizes, largest, sum(linear.values())


def memory_estimate(
    config: Any,
    world_size: int,
    tensor_parallel: int | None = None,
    parts: tuple[list[int], int, int] | None = None,
) -> Any:
    """core.memory_estimate's figure for this config at `world_size` (None for LoRA: most weights are frozen),
    at scaling.tensor_parallel unless `tensor_parallel` is given; `parts`: `model_parts(config)` where
    the caller has it (each build of the empty model costs a fraction of a second)."""
    from elastictrain.config.deepspeed_config import NVME_SUB_GROUP, live_parameters
    from elastictrain.core.memory_estimate import estimate_rank_memory, gathered_params, largest_sub_group

    if config.model.lora.enabled:
        return None
    n = int(config.scaling.tensor_parallel) if tensor_parallel is None else tensor_parallel
    sizes, largest, sliced = parts or model_parts(config)
    params = sum(sizes)
    largest = gathered_params(largest, params, live_parameters(config), config.deepspeed.zero_stage)
    ds, t = config.deepspeed, config.training
    # DeepSpeed's optimizer swapper stages sub-groups through 4 fp32 buffers of its largest sub-group.
    partitions = [-(-size // world_size) for size in sizes]
    swap = 4 * 4 * largest_sub_group(partitions, NVME_SUB_GROUP) if ds.offload_optimizer == "nvme" else 0
    return estimate_rank_memory(
        params,
        largest,
        world_size,
        zero_stage=ds.zero_stage,
        precision=t.precision,
        offload_optimizer=ds.offload_optimizer,
        offload_param=ds.offload_param,
        use_gpu=config.scaling.use_gpu,
        swap_buffer_bytes=swap,
        memory_snapshots=config.checkpoint.memory_every_steps > 0,
        allocator=config.scaling.worker_allocator,
        tensor_parallel=n,
        sliced_params=sliced if n > 1 else 0,
    )


def check_memory_on_nodes(config: Any, timeout_s: float = 60.0) -> Any:
    """The per-rank estimate at scaling.min_workers (the largest share each rank holds); raises
    PreflightError when the alive worker nodes cannot hold min_workers such ranks in their memory."""
    from elastictrain.core.memory_estimate import GIB, memory_shortfall

    s = config.scaling
    estimate = memory_estimate(config, s.min_workers)
    nodes = worker_nodes(config)
    if estimate is None or not nodes:
        return estimate  # no node yet: the run waits for capacity, and the workers' own memory decides
    answers, _ = on_each_node(nodes, node_memory_probe, timeout_s=timeout_s)
    known = [(n, mem) for n, (_, mem) in answers if mem]
    if not known:
        return estimate
    slots = [node_slots(n.get("Resources", {}), config) for n, _ in known]
    n = int(s.tensor_parallel)  # resolved by now where it was `auto`
    fit = memory_shortfall([mem for _, mem in known], slots, estimate.host_need, s.min_workers, n)
    if fit is not None:
        biggest = max(mem for _, mem in known)
        raise PreflightError(
            f"{estimate.describe()}; the worker nodes can hold {fit} such rank(s) in memory "
            f"(largest node: {biggest / GIB:.1f} GiB), fewer than scaling.min_workers={s.min_workers}. "
            "Offload the optimizer to NVMe (deepspeed.offload_optimizer=nvme, deepspeed.nvme_path=DIR), use "
            "bf16, a larger scaling.tensor_parallel (or auto), a smaller model, or nodes with more memory"
        )
    return estimate


def node_slots(resources: dict[str, float], config: Any) -> int:
    """The ranks a node with these Ray resources holds (CPU slots, GPUs with use_gpu, max_workers)."""
    s = config.scaling
    by_cpu = int(resources.get("CPU", 0) // s.cpus_per_worker) if s.cpus_per_worker else s.max_workers
    if s.use_gpu:
        by_cpu = min(by_cpu, int(resources.get("GPU", 0) // s.gpus_per_worker))
    return min(by_cpu, s.max_workers)
