"""The Python API: `elastictrain.fit(config, model=..., dataset=..., loss=...)` trains with your own code.

    import elastictrain

    summary = elastictrain.fit(
        "examples/plain_module/config.yaml",
        model=build_model,        # config -> torch.nn.Module (or a module to copy, for small models)
        dataset=build_dataset,    # config -> map-style dataset (or the dataset itself)
        loss=compute_loss,        # (model, batch) -> scalar tensor
        local=True,               # one worker in this process; drop it to run on Ray
    )

Each object is recorded in the run's config as its import path when it has one ("mypkg.models:build"),
so the same run can be launched or resumed from the CLI; objects without one (defined in __main__, a
closure, a lambda) are labelled ('<__main__.build_model>') and carried to the workers by value.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.config import Config, load_config, validate

if TYPE_CHECKING:
    from elastictrain.control.loop import RunSummary
    from elastictrain.control.progress import Reporter

log = logging.getLogger("elastictrain.api")


def fit(
    config: Config | str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    model: Any = None,
    dataset: Any = None,
    loss: Callable[[Any, Any], Any] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    local: bool = False,
    address: str | None = None,
    tracking: bool = True,
    fresh: bool = False,
    reporter: Reporter | None = None,
    controller_hook: Callable[[Any], None] | None = None,
) -> RunSummary:
    """Train `config` (a Config, or a YAML path plus dotlist overrides) with your own pieces.

    - model: a callable returning a torch.nn.Module, called with the run's Config when it takes a
      positional argument (else with none), inside DeepSpeed's zero.Init; or an nn.Module (copied to
      each worker; fine for small models).
    - dataset: a map-style dataset (len(ds), ds[i]) or a callable returning one, called the same way.
    - loss: loss(model, batch) -> scalar tensor; `model` is the DeepSpeed engine, called like your
      module. Default: the causal LM loss of a transformers model.
    - collate: collate(list of items) -> batch. Default: stack tensors, or dicts/tuples of tensors.
    - local: one worker in this process, no Ray (same code path, world size 1).

    The run continues a run of the same config in `run.dir` (fresh=True moves it aside and starts
    over). Returns the run's summary: `summary.status.value` is "FINISHED" when it finished.
    """
    from elastictrain.driver.launch import check_before_start, prepare_run_dir, run_training
    from elastictrain.user_code import attach, label_for

    if isinstance(config, Config):
        if overrides:
            raise TypeError("fit: overrides apply to a YAML config; edit the Config object instead")
        cfg = copy.deepcopy(config)
    else:
        cfg = load_config(config, overrides)
    objects: dict[str, Any] = {}
    for key, obj in (
        ("model.factory", model),
        ("data.factory", dataset),
        ("data.collate", collate),
        ("training.loss", loss),
    ):
        if obj is None:
            continue
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, label_for(obj))
        objects[key] = obj
    if dataset is not None:
        cfg.data.source = "factory"
    cfg = validate(cfg)
    attach(cfg, objects)
    check_before_start(cfg)
    from elastictrain.driver.launch import resolve_length

    for line in resolve_length(cfg):  # epochs to steps, before config.yaml and its digest are written
        log.info(line)
    from elastictrain.rundir.lock import RunLock

    with RunLock(cfg.run.dir):  # raises RunFolderBusy while another driver has the folder
        run_dir, resumed = prepare_run_dir(cfg, fresh=fresh)
        if resumed:
            log.warning(
                "run.dir %s already holds this run: continuing it (fresh=True starts over)", run_dir.path
            )
        return run_training(
            cfg,
            run_dir,
            address=address,
            tracking=tracking,
            reporter=reporter,
            controller_hook=controller_hook,
            local=local,
        )
