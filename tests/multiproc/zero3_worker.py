"""torchrun worker (2 processes, gloo, CPU): DeepSpeed ZeRO-3 training of an hf_attnorm model.

Loads ``--model`` under ZeRO-3 (parameters partitioned at load by transformers' ``HfDeepSpeedConfig``), builds the
training script's parameter groups and parameter count from the partitioned model, trains ``--steps`` steps on this
rank's half of a fixed batch, and writes into ``--out``: ``result.json`` (per-step mean loss over ranks, group sizes,
parameter count, the learned per-head values gathered) and ``final/`` (the training script's final save).
The test (tests/test_stacks.py) compares all of it with one process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

import hf_attnorm  # noqa: E402, F401
from hf_attnorm.hf.distributed import logical_shape  # noqa: E402
from hf_attnorm.lab.distributed import gathered_state_dict  # noqa: E402
from hf_attnorm.lab.training.loop import _param_groups as param_groups  # noqa: E402
from hf_attnorm.lab.training.loop import _unique_params as unique_params  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint folder to load")
    p.add_argument("--implementation", required=True, help="attn_implementation name")
    p.add_argument("--attnorm", default="{}", help="attnorm settings as JSON")
    p.add_argument("--batch", required=True, help="a .pt file with the full batch input_ids [B, L]")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    p.add_argument("--out", required=True, help="output folder")
    a = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.load(a.batch)
    per_rank = batch.shape[0] // world
    # persistence threshold and reuse distance 0: the per-head values are released after every use, so every call
    # must gather them (stricter than DeepSpeed's default, which keeps parameters under 1e5 elements resident)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0}
    cfg = {"train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1,
           "train_batch_size": per_rank * world, "zero_optimization": zero,
           "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841  (kept alive: from_pretrained partitions under zero.Init)
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=a.implementation,
                                                 attnorm=json.loads(a.attnorm), dtype=torch.float32)
    partitioned = [n for n, q in model.named_parameters() if q.numel() == 0 and hasattr(q, "ds_id")]
    attnorm_names = [n for n, _ in model.named_parameters() if ".attnorm." in n]
    groups = param_groups(model, a.weight_decay)
    group_shapes = [[list(logical_shape(q)) for q in g["params"]] for g in groups]
    n_params = unique_params(model)
    optimizer = torch.optim.AdamW(groups, lr=a.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    mine = batch[rank * per_rank:(rank + 1) * per_rank]
    losses = []
    for _ in range(a.steps):
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = gathered_state_dict(engine.module)  # collective: every rank calls it
    out = Path(a.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        engine.module.save_pretrained(out / "final", state_dict=state, safe_serialization=True)
        values = {n: state[n].tolist() for n in attnorm_names}
        result = {"losses": losses, "group_shapes": group_shapes, "group_decay": [g["weight_decay"] for g in groups],
                  "num_params": n_params, "partitioned": partitioned, "attnorm_values": values, "world": world}
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    # without an explicit teardown, gloo's worker threads can still hold work at interpreter exit and abort the
    # process (SIGABRT, "terminate called without an active exception") after everything above succeeded
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
