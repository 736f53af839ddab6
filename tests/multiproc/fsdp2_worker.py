"""torchrun worker (2 processes, gloo, CPU): torch FSDP2 (``fully_shard``) training of an hf_attnorm model.

1. Loads ``--model`` with a normalizer swap under transformers' low-memory FSDP loading (the test sets
   ``ACCELERATE_USE_FSDP``/``FSDP_CPU_RAM_EFFICIENT_LOADING``): on rank 1 the per-head values the swap creates are
   not in the checkpoint and used to stay on ``meta``; every parameter must now be real on every rank.
2. Shards every decoder layer and the root with ``fully_shard``, trains ``--steps`` AdamW steps on this rank's half
   of a fixed batch, gathers a full state dict and saves it with ``save_pretrained`` into ``--out/final``.
``--out/result.json``: meta parameters after loading (per rank), per-step mean loss, the learned per-head values,
and whether they were sharded (DTensor) during training. The test (tests/test_stacks.py) compares with one process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_attnorm  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint folder to load (saved without our implementation)")
    p.add_argument("--implementation", required=True, help="attn_implementation name to swap to")
    p.add_argument("--attnorm", default="{}", help="attnorm settings as JSON")
    p.add_argument("--batch", required=True, help="a .pt file with the full batch input_ids [B, L]")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--out", required=True, help="output folder")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=a.implementation,
                                                 attnorm=json.loads(a.attnorm), dtype=torch.float32)
    meta = [n for n, q in model.named_parameters() if q.device.type == "meta"]
    metas = [None] * world
    dist.all_gather_object(metas, meta)
    attnorm_names = [n for n, _ in model.named_parameters() if ".attnorm." in n]
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = sorted(n for n, q in model.named_parameters() if ".attnorm." in n and isinstance(q, DTensor))
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    batch = torch.load(a.batch)
    per_rank = batch.shape[0] // world
    mine = batch[rank * per_rank:(rank + 1) * per_rank]
    losses = []
    for _ in range(a.steps):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out / "final", state_dict=state, safe_serialization=True)
        values = {n: state[n].tolist() for n in attnorm_names}
        result = {"meta_after_load": metas, "losses": losses, "attnorm_values": values,
                  "sharded_attnorm": sharded, "world": world}
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
