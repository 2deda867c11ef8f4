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
