"""Which slice of which dimension each parameter of an AutoTP engine holds, as DeepSpeed records it.

AutoTP (`tensor_parallel.autotp_size`) replaces each sliced linear layer's weight by this rank's slice
and tags the parameter with the metadata its universal checkpoint converts from (the attribute named by
`deepspeed.checkpoint.constants.DS_AUTOTP_UC_META`: partition dim, partition sizes, original shape, or
`replicated`). Checkpoints name each slice by that record (checkpoint/tensor_slices.py), so a checkpoint
saved at one tensor-parallel size loads at another. This module is the one place that reads it.
"""

from __future__ import annotations

from typing import Any

# (dim, index, count): slice `index` of `count` along dimension `dim`
Slicing = tuple[int, int, int]


def _meta_attribute() -> str:
    try:
        from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    except ImportError as e:  # older DeepSpeed: no record of what AutoTP sliced
        raise RuntimeError(
            "scaling.tensor_parallel > 1 needs a DeepSpeed that records AutoTP's slicing "
            "(deepspeed.checkpoint.constants.DS_AUTOTP_UC_META, 0.19.8); install the tested release"
        ) from e
    return str(DS_AUTOTP_UC_META)


def tensor_slices(engine: Any, tensor_parallel: int, tp_rank: int) -> dict[Any, Slicing]:
    """Every parameter AutoTP sliced on this rank (rank `tp_rank` of `tensor_parallel`), by parameter."""
    if tensor_parallel <= 1:
        return {}
    attribute = _meta_attribute()
    out: dict[Any, Slicing] = {}
    for _name, param in engine.module.named_parameters():
        meta = getattr(param, attribute, None)
        if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
            continue  # the whole parameter on every rank of the replica (norms, embeddings)
        sizes = tuple(int(s) for s in meta.get("partition_sizes") or ())
        if len(sizes) != tensor_parallel:
            raise RuntimeError(
                f"AutoTP recorded {len(sizes)} partitions for a parameter of shape {tuple(param.shape)} "
                f"at tensor_parallel {tensor_parallel}"
            )
        out[param] = (int(meta["partition_dim"]), tp_rank, tensor_parallel)
    return out


def _engine_degree(engine: Any) -> int:
    """The engine's AutoTP degree (0 or 1: none)."""
    size_of = getattr(engine, "autotp_size", None)
    return int(size_of()) if callable(size_of) else 0


def engine_tensor_slices(engine: Any) -> dict[Any, Slicing]:
    """`tensor_slices` of an engine, at its own tensor-parallel size and this rank's place in it."""
    size = _engine_degree(engine)
    if size <= 1:
        return {}
    from deepspeed.utils import groups

    return tensor_slices(engine, size, int(groups.get_tensor_model_parallel_rank()))


def data_parallel_rank(engine: Any) -> int:
    """This rank's place among the ranks that hold the same slices (DeepSpeed's (data, tensor) mesh puts
    each replica's ranks next to each other; a pipeline engine's grid says it for its stage)."""
    grid = getattr(engine, "grid", None)
    if grid is not None and hasattr(grid, "get_data_parallel_rank"):
        return int(grid.get_data_parallel_rank())
    rank = int(getattr(engine, "global_rank", 0))
    size = _engine_degree(engine)
    return rank // size if size > 1 else rank
