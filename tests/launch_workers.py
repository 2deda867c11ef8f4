"""Worker functions and helpers for the launch/elastic/heartbeat/stop tests (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def listening_sockets(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every TCP socket in LISTEN state that one of ``pids`` holds (from /proc)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:
                continue
            addr_hex, port_hex = local.split(":")
            if width == 8:
                addr = ".".join(str(int(addr_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                words = [addr_hex[i:i + 8] for i in range(0, 32, 8)]
                raw = b"".join(bytes.fromhex(w)[::-1] for w in words)
                import ipaddress
                addr = str(ipaddress.IPv6Address(raw))
            out.append((inodes[inode], addr, int(port_hex, 16)))
    return out


def descendants(pid: int) -> set[int]:
    from adaptdist.runtime.launch import _descendants

    return _descendants(pid)


def restart_worker(kill_rank: int, mode: str, sockets_file: str | None = None) -> dict:
    """all_reduce; on the first attempt rank ``kill_rank`` dies (``mode``: "kill" SIGKILLs itself, "raise"
    raises ValueError, "exit" exits 3); a later attempt finishes. ``mode`` "always-kill"/"always-raise"
    fail on every attempt. Rank 0 writes the listening sockets of the launcher and workers to
    ``sockets_file`` on the first attempt."""
    from adaptdist.runtime.launch import restart_count

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    if sockets_file and rank == 0 and restart_count() == 0:
        launcher = os.getppid()
        pids = {launcher} | descendants(launcher)
        with open(sockets_file, "w") as f:
            for pid, addr, port in listening_sockets(pids):
                f.write(f"{pid} {addr} {port}\n")
    dist.barrier()
    if rank == kill_rank and (restart_count() == 0 or mode.startswith("always")):
        if mode.endswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if mode.endswith("raise"):
            raise ValueError(f"injected failure on rank {rank}")
        if mode == "exit":
            raise SystemExit(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"restart_count": restart_count(), "world": int(os.environ["WORLD_SIZE"]),
            "master_addr": os.environ["MASTER_ADDR"], "value": t.item()}


def stall_worker(stall_rank: int, stall_step: int, stall_s: float, steps: int) -> dict:
    """A step loop that beats and all_reduces; rank ``stall_rank`` sleeps ``stall_s`` at ``stall_step`` (after
    its beat, before the collective). Returns each rank's named error (or None) and when it came."""
    from adaptdist.runtime.heartbeat import Heartbeat, named_timeout

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hb = Heartbeat(rank, world)
    for step in range(steps):
        hb.beat(step)
        if rank == stall_rank and step == stall_step:
            time.sleep(stall_s)
        t0 = time.monotonic()
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
        except Exception as e:
            err = named_timeout(e, hb, step)
            return {"error": str(err), "type": type(err).__name__, "after_s": time.monotonic() - t0,
                    "step": step}
    dist.destroy_process_group()
    return {"error": None}


def stop_worker(out_dir: str, steps: int, step_s: float, term_rank: int = -1, term_step: int = -1) -> dict:
    """A step loop under StopRequest: all_reduce, progress file ``progress-RANK`` (the last step done); rank
    ``term_rank`` SIGTERMs itself after step ``term_step``. On an agreed stop it writes ``stopped-RANK`` (the
    step) and exits 128 + signal."""
    from adaptdist.runtime.stop import StopRequest, stop_exit_code

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with StopRequest() as stop:
        for step in range(steps):
            t = torch.ones(1)
            dist.all_reduce(t)
            time.sleep(step_s)
            with open(os.path.join(out_dir, f"progress-{rank}"), "w") as f:
                f.write(str(step))
            if rank == term_rank and step == term_step:
                os.kill(os.getpid(), signal.SIGTERM)
            sig = stop.agreed(step)
            if sig is not None:
                with open(os.path.join(out_dir, f"stopped-{rank}"), "w") as f:
                    f.write(f"{step} {sig}")
                dist.destroy_process_group()
                raise SystemExit(stop_exit_code(sig))
    dist.destroy_process_group()
    return {"finished": True}


def data_error_worker(same: bool) -> None:
    """Every rank raises DataError (as each rank's loader does on a batch of the wrong size): the same message
    on every rank when ``same``, else one naming the rank."""
    from adaptdist.errors import DataError

    rank = int(os.environ["RANK"])
    raise DataError("batch 2 has 5 rows, expected 7" if same else f"rank {rank}'s shard is empty")
