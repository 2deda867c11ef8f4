"""Does the stall-CPU assertion catch a spinning wait? fault_worker with the 'stall' group spinning 1.4 s (of 1.5 s)."""
import sys, functools
sys.path.insert(0, "tests")
import shm_workers as w

def spinning_fault_worker(rank, world, stall_timeout_s, spin_us):
    from adaptdist.kernels import shm
    orig = shm.init_group
    def patched(pg, name=None, **kw):
        if name == "stall" and spin_us is not None:
            kw["spin_us"] = spin_us
        return orig(pg, name=name, **kw)
    shm.init_group = patched
    return w.fault_worker(rank, world, stall_timeout_s)

if __name__ == "__main__":
    for spin in (None, 1_400_000.0):
        res = w.run_ranks(spinning_fault_worker, 3, (1.5, spin), timeout_s=240)
        for r in (0, 1):
            out = res.get(r, {})
            print(f"spin_us={spin} rank {r}: stall_s={out.get('stall_s')} stall_cpu_s={out.get('stall_cpu_s')} "
                  f"ratio={(out.get('stall_cpu_s') or 0) / (out.get('stall_s') or 1):.2f} error={'error' in out}")
