import torch

from adaptdist.runtime.memory import PeakMemory


def test_peak_counts_existing_and_new_tensors_until_freed():
    w = torch.randn(256, 256)  # 256 KiB
    nbytes = w.numel() * 4
    with PeakMemory([w]) as pm:
        a = torch.randn(256, 256)
        b = a @ w          # live: w, a, b
        del a
        c = b + 1          # live: w, b, c (a was freed)
        del b, c
    assert pm.report.start_bytes == nbytes
    assert pm.report.peak_bytes == 3 * nbytes
    assert pm.report.rss_peak_bytes > 0


def test_views_share_one_storage():
    with PeakMemory() as pm:
        a = torch.zeros(1000)
        v = a.view(10, 100)
        t = v.t()
        del v, t
    assert pm.report.peak_bytes == 4000


def test_tensor_subclasses_are_counted_by_what_they_wrap():
    """DTensor (and functional-collective wrappers) own no storage; they must not crash the meter."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        d = distribute_tensor(torch.ones(256, 256), init_device_mesh("cpu", (1,)), [Shard(0)])
        with PeakMemory() as pm:
            e = d * 2
        assert pm.report.peak_bytes >= 256 * 256 * 4
        del e
    finally:
        dist.destroy_process_group()
