"""A tiny entry module for the elastic launch tests: all_reduces in a loop, records its world size per attempt.

``python -m elastic_entry OUT_DIR STEPS [STEP_S]`` (under an elastic agent): each attempt of each rank writes
``OUT_DIR/attempt-<pid>.json`` with its RANK, WORLD_SIZE, restart count and the steps it completed; the loop
ends after STEPS all_reduces (each checked against the world size), sleeping STEP_S seconds per step.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    step_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"pid": os.getpid(), "rank": rank, "world_size": world, "started": time.time(),
              "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "steps": 0}
    path = os.path.join(out_dir, f"attempt-{os.getpid()}.json")

    def save() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    save()
    for step in range(steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world, (t.item(), world)
        record["steps"] = step + 1
        record["last_step_time"] = time.time()
        save()
        time.sleep(step_s)
    dist.barrier()
    record["finished"] = True
    save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
