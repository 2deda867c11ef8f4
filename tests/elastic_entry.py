"""A tiny entry module for the elastic launch tests: all_reduces in a loop, records its world size per attempt.

``python -m elastic_entry OUT_DIR STEPS [STEP_S [stop]]`` (under an elastic agent): each attempt of each rank
writes ``OUT_DIR/attempt-<pid>.json`` with its RANK, WORLD_SIZE, restart count and the steps it completed; the
loop ends after STEPS all_reduces (each checked against the world size), sleeping STEP_S seconds per step.
With ``stop``, the loop runs under a StopRequest: on an agreed SIGTERM/SIGINT it records ``stopped_at`` and
exits 128 + signal.
"""

import json
import os
import signal
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
    from adaptdist.runtime.stop import StopRequest, stop_exit_code

    with StopRequest(signals=(signal.SIGTERM, signal.SIGINT) if "stop" in sys.argv[4:] else ()) as stop:
        for step in range(steps):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world, (t.item(), world)
            record["steps"] = step + 1
            record["last_step_time"] = time.time()
            save()
            time.sleep(step_s)
            sig = stop.agreed(step) if stop.signals else None
            if sig is not None:
                record["stopped_at"] = step
                save()
                dist.destroy_process_group()
                raise SystemExit(stop_exit_code(sig))
    dist.barrier()
    record["finished"] = True
    save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
