"""Greedy completions through pipeline stages (`eval.prompts` with `scaling.pipeline_parallel`).

DeepSpeed's pipeline engine trains and evaluates losses but does not generate. Here each new token is
one forward of the whole sequence through the replica's stages: the first embeds the tokens, each stage
sends its hidden states to the next, the last picks the most likely token and sends it to every stage
of its replica, which all append it. Stages pass hidden states only, so no key-value cache is kept: a
completion of n tokens costs n forwards of the growing sequence (what validation prompts can afford).
Every replica generates the same text from the same weights.
"""

from __future__ import annotations

from typing import Any

import torch


def greedy_through_stages(engine: Any, ids: list[int], max_new_tokens: int, ends: set[int]) -> list[int]:
    """The tokens greedy decoding adds to `ids` (at most `max_new_tokens`, the last one in `ends` if it
    ended), on every stage of this rank's replica; every stage must call it with the same arguments."""
    import torch.distributed as dist

    module, grid = engine.module, engine.grid
    stages = grid.pp_group  # this replica's ranks, stage by stage
    stage = grid.get_stage_id()
    group = grid.get_pipe_parallel_group()
    width, dtype = module.hf_record["config"]["hidden_size"], next(module.parameters()).dtype
    tokens = list(ids)
    new: list[int] = []
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                if stage == 0:
                    x = module(torch.tensor([tokens], device=engine.device))
                else:
                    x = torch.empty((1, len(tokens), width), dtype=dtype, device=engine.device)
                    dist.recv(x, src=stages[stage - 1])
                    x = module(x)
                chosen = torch.zeros(1, dtype=torch.long, device=engine.device)
                if stage < len(stages) - 1:
                    dist.send(x.contiguous(), dst=stages[stage + 1])
                else:
                    chosen[0] = int(x[0, -1].float().argmax())
                dist.broadcast(chosen, src=stages[-1], group=group)
                token = int(chosen[0])
                tokens.append(token)
                new.append(token)
                if token in ends:
                    break
    finally:
        module.train(was_training)
    return new
