"""Peak memory per rank: the one metric every benchmark (and later the cost model) uses.

Definition: the peak, over a region (one training step), of the total bytes of
live tensor storages: tensors alive when the region starts (parameters,
optimizer state, batch) plus every tensor an ATen op creates inside it, each
counted from its creation until its storage is freed. Storages are counted
once however many views share them. torch has no CPU allocator statistics, so
this is measured with a TorchDispatchMode; process RSS is reported beside it.
"""

from __future__ import annotations

import resource
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .. import _torch_compat as compat
from .._torch_compat import tree_leaves


@dataclass(frozen=True)
class MemoryReport:
    """``peak_bytes``: peak live tensor bytes in the region; ``rss_peak_bytes``: the process's max RSS."""

    peak_bytes: int
    start_bytes: int
    rss_peak_bytes: int

    def __str__(self) -> str:
        return f"peak {self.peak_bytes / 2**20:.1f} MiB live tensors (RSS max {self.rss_peak_bytes / 2**20:.0f} MiB)"


def rss_peak_bytes() -> int:
    """Max resident set size of this process so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Meter(compat.torch_dispatch_mode_base()):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            # tensor subclasses (DTensor, functional-collective wrappers) own no storage of
            # their own: count the plain tensors they wrap
            inner = [getattr(t, a) for a in ("_local_tensor", "elem") if isinstance(getattr(t, a, None), torch.Tensor)]
            for x in inner:
                self.track(x)
            if inner:
                return
        try:
            st = t.untyped_storage()
            st.data_ptr()
        except (RuntimeError, NotImplementedError):
            return  # a wrapper with no real storage
        key = id(st) if st.data_ptr() == 0 else st.data_ptr()
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.track(t)
        return out


class PeakMemory:
    """Context manager measuring the peak-memory metric over a region.

    Usage::

        with PeakMemory(existing=[params, opt_state, batch]) as pm:
            step()
        print(pm.report.peak_bytes)
    """

    def __init__(self, existing: Iterable[Any] = ()):
        self._existing = list(existing)
        self.report: MemoryReport | None = None
        self._meter: _Meter | None = None

    def __enter__(self) -> "PeakMemory":
        self._meter = _Meter()
        for t in tree_leaves(self._existing):
            self._meter.track(t)
        self._start = self._meter.current
        self._existing = []
        self._meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._meter is not None
        self._meter.__exit__(*exc)
        self.report = MemoryReport(self._meter.peak, self._start, rss_peak_bytes())
        self._meter = None
