"""adaptdist's C++ kernels in one process: loading and the gloo fallback, the ops' Meta kernels and how they
trace (make_fx, torch.compile), group argument checks, stale-segment removal, error translation.
The multi-rank behaviour is in tests/test_shm_collectives.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import pytest
import torch

import adaptdist.kernels as kernels
from adaptdist.errors import CollectiveTimeoutError, ShmPeerError
from adaptdist.kernels import shm

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"C++ kernels not built: {kernels.load_error()}")


_FALLBACK_SCRIPT = r"""
import json, os, sys, warnings
warnings.simplefilter("always")
bad = sys.argv[1]
os.environ["ADAPTDIST_KERNELS"] = bad
with warnings.catch_warnings(record=True) as caught:
    import torch, adaptdist, adaptdist._torch_compat   # import must not raise
    from adaptdist import kernels
    from adaptdist.errors import ShmUnavailableError
    from adaptdist.kernels import shm
    out = {"corrupt_available": kernels.available(), "corrupt_available_again": kernels.available(),
           "corrupt_error": kernels.load_error()}
out["corrupt_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
for case, value in (("missing", bad + ".absent"), ("disabled", "0")):
    os.environ["ADAPTDIST_KERNELS"] = value
    kernels.load.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        out[case + "_available"] = kernels.available()
        out[case + "_error"] = kernels.load_error()
    out[case + "_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    try:
        kernels.require("comm='shm'")
    except ShmUnavailableError as e:
        out[case + "_require"] = str(e)
    try:
        shm.init_group(None)
    except ShmUnavailableError as e:
        out[case + "_init_group"] = type(e).__name__
print("RESULT " + json.dumps(out))
"""


def test_unloadable_library_warns_once_and_falls_back(tmp_path):
    """A fresh process (nothing loaded yet): a corrupt library (at `import adaptdist`), a missing one and
    ADAPTDIST_KERNELS=0 each leave the kernels unavailable with one warning (none when disabled), never an
    exception at import; an explicit request raises ShmUnavailableError saying why and what to use."""
    bad = tmp_path / "_kernels.so"
    bad.write_bytes(b"\x7fELF this is not a shared library")
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, str(bad)], capture_output=True, text=True,
                          timeout=180, env={k: v for k, v in os.environ.items() if k != "ADAPTDIST_KERNELS"})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["corrupt_available"] is False and out["corrupt_available_again"] is False
    assert "could not be loaded" in out["corrupt_error"]
    assert len(out["corrupt_warnings"]) == 1 and "using gloo" in out["corrupt_warnings"][0]
    assert out["missing_available"] is False and "does not exist" in out["missing_error"]
    assert len(out["missing_warnings"]) == 1
    assert out["disabled_available"] is False and "disabled" in out["disabled_error"]
    assert out["disabled_warnings"] == []
    for case in ("missing", "disabled"):
        assert "comm='auto' or comm='gloo'" in out[case + "_require"]
        assert out[case + "_init_group"] == "ShmUnavailableError"


@needs_kernels
def test_ops_trace_by_name_with_meta_shapes():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        a = torch.ops.adaptdist.shm_all_reduce(x, "sum", "tp")
        b = torch.ops.adaptdist.shm_all_gather_into_tensor(a, 4, "tp")
        c = torch.ops.adaptdist.shm_reduce_scatter_tensor(b, "avg", 4, "tp")
        d = torch.ops.adaptdist.shm_all_to_all_single(c, [], [], "tp")
        return torch.ops.adaptdist.shm_broadcast(d, 0, "tp")

    x = torch.randn(8, 3)
    gm = make_fx(f, tracing_mode="fake")(x)
    code = gm.code
    for name in ("shm_all_reduce", "shm_all_gather_into_tensor", "shm_reduce_scatter_tensor",
                 "shm_all_to_all_single", "shm_broadcast"):
        assert f"torch.ops.adaptdist.{name}.default" in code, code
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "call_function"]
    assert shapes == [(8, 3), (32, 3), (8, 3), (8, 3), (8, 3)]
    meta = torch.ops.adaptdist.shm_all_gather_into_tensor(torch.empty(2, 5, device="meta"), 3, "g")
    assert meta.shape == (6, 5) and meta.device.type == "meta"


@needs_kernels
def test_torch_compile_traces_the_ops():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return lambda *args: (torch.zeros(4),)  # record only: no group exists in this process

    f = torch.compile(lambda x: torch.ops.adaptdist.shm_all_reduce(x * 2, "sum", "dp") + 1, backend=backend,
                      fullgraph=True)
    f(torch.ones(4))
    assert len(graphs) == 1 and "torch.ops.adaptdist.shm_all_reduce" in graphs[0]


@needs_kernels
def test_op_argument_errors_name_the_problem():
    with pytest.raises(RuntimeError, match="no shared-memory group named 'nowhere'.*init_group"):
        torch.ops.adaptdist.shm_all_reduce(torch.ones(3), "sum", "nowhere")
    with pytest.raises(ValueError, match="reduce_op 'prod' is not supported"):
        torch.ops.adaptdist.shm_all_reduce(torch.ones(3), "prod", "nowhere")
    with pytest.raises(TypeError, match="does not support dtype Long"):
        torch.ops.adaptdist.shm_all_reduce(torch.ones(3, dtype=torch.long), "sum", "nowhere")


def test_stale_segments_of_dead_creators_are_removed(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    stale = tmp_path / f"adaptdist-4242-{dead_pid}-abcd-world"
    live = tmp_path / f"adaptdist-4242-{os.getpid()}-abcd-world"
    other_job = tmp_path / f"adaptdist-4243-{dead_pid}-abcd-world"
    for p in (stale, live, other_job):
        p.write_bytes(b"x")
    assert shm.remove_stale_segments("4242", shm_dir=tmp_path) == [stale.name]
    assert not stale.exists() and live.exists() and other_job.exists()


def test_translate_error_names_the_peer():
    exc = RuntimeError("adaptdist shm: all_reduce on group 'tp' (2 ranks; this is group rank 0, global rank 2, "
                       "pid 10): peer group rank 1 (global rank 3, pid 11) died (its process is gone) "
                       "[peer_group_rank=1 peer_global_rank=3 peer_pid=11]")
    typed = shm.translate_error(exc)
    assert isinstance(typed, ShmPeerError) and isinstance(typed, CollectiveTimeoutError)
    assert (typed.group, typed.peer_group_rank, typed.peer_global_rank, typed.peer_pid) == ("tp", 1, 3, 11)
    assert shm.translate_error(RuntimeError("something else")) is None


@needs_kernels
def test_comm_thread_runs_the_ops_and_reraises_their_errors(tmp_path, monkeypatch):
    """``init_group(comm_thread=True)``: the ops run on the group's own thread, results and errors as on the caller's
    (a one-rank group: the reduction, the output and the error path all cross the hand-over; inputs over 32 KiB,
    since smaller blocking ones run on the caller's thread while the comm thread is idle, also checked)."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_PORT", "0")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for on in (True, False):
            g = shm.init_group(name=f"ct{int(on)}", comm_thread=on, timeout_s=10.0)
            for numel in (10, 40_000):  # 20 and 80,000 bytes: on the caller's thread, then handed over
                x = torch.arange(numel, dtype=torch.float32)[::2]  # non-contiguous
                assert torch.equal(torch.ops.adaptdist.shm_all_reduce(x, "avg", g.name), x)
                assert torch.equal(torch.ops.adaptdist.shm_all_gather_into_tensor(x, 1, g.name), x)
                with pytest.raises(ValueError, match="reduce_op .min. is not supported"):  # as unthreaded
                    torch.ops.adaptdist.shm_all_reduce(x, "min", g.name)
                assert torch.equal(torch.ops.adaptdist.shm_broadcast(x, 0, g.name), x)  # usable after the error
            shm.destroy_group(g.name)
    finally:
        dist.destroy_process_group()


@needs_kernels
def test_started_collectives_complete_at_the_wait_in_order(tmp_path, monkeypatch):
    """``shm_*_start`` + ``shm_wait``: with the comm thread on, the caller gets the output at once and the job fills
    it in submission order (started and run-to-completion ops of one group mixed); with it off, the start runs the
    collective itself. Results equal the synchronous ops'; a wait on a tensor no collective fills returns it; bad
    arguments raise at the start, with the synchronous op's type."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_PORT", "0")
    ops = torch.ops.adaptdist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for on in (True, False):
            g = shm.init_group(name=f"st{int(on)}", comm_thread=on, timeout_s=10.0)
            xs = [torch.randn(n)[::2] for n in (2, 7, 300_000, 3_000_000)]  # up to 6 MiB: the reused output block
            started = []
            for x in xs:
                started.append((ops.shm_all_reduce_start(x, "sum", g.name), x.clone()))
                started.append((ops.shm_all_gather_into_tensor_start(x, 1, g.name), x.clone()))
                started.append((ops.shm_reduce_scatter_tensor_start(x, "avg", 1, g.name), x.clone()))
                assert torch.equal(ops.shm_all_reduce(x, "max", g.name), x)  # queued behind the started ones
            for out, want in started:
                assert torch.equal(ops.shm_wait(out), want)
            y = torch.ones(3)
            assert ops.shm_wait(y) is y
            with pytest.raises(ValueError, match="reduce_op .min. is not supported"):
                ops.shm_all_reduce_start(y, "min", g.name)
            with pytest.raises(ValueError, match="group_size 2"):
                ops.shm_all_gather_into_tensor_start(y, 2, g.name)
            with pytest.raises(TypeError, match="does not support dtype"):
                ops.shm_reduce_scatter_tensor_start(torch.ones(2, dtype=torch.int64), "sum", 1, g.name)
            assert torch.equal(ops.shm_wait(ops.shm_all_reduce_start(y, "sum", g.name)), y)  # usable after
            shm.destroy_group(g.name)
        meta = torch.empty(4, 3, device="meta")
        assert ops.shm_all_gather_into_tensor_start(meta, 2, "any").shape == (8, 3)
        assert ops.shm_reduce_scatter_tensor_start(meta, "sum", 2, "any").shape == (2, 3)
        assert ops.shm_wait(ops.shm_all_reduce_start(meta, "sum", "any")).shape == (4, 3)
    finally:
        dist.destroy_process_group()


@needs_kernels
def test_input_buffer_bounds_and_the_flatten_op_on_one_rank(tmp_path, monkeypatch):
    """``shm.input_buffer``: a tensor on the rank's registered input region, persistent between calls; sizes or
    offsets outside the 64 MiB region raise UsageError naming the group, the size and the limit (the op itself a
    ValueError). ``shm_flatten_all_reduce_start`` on one rank returns the flattened bucket (cat's result), also
    where it does not fit the region; its Meta kernel gives the 1-d shape."""
    import torch.distributed as dist

    from adaptdist.errors import UsageError

    monkeypatch.setenv("MASTER_PORT", "0")
    ops = torch.ops.adaptdist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        g = shm.init_group(name="reg", timeout_s=10.0)
        b = g.input_buffer(1000, torch.bfloat16, offset_bytes=128)
        assert b.shape == (1000,) and b.dtype == torch.bfloat16 and b.is_contiguous()
        b.fill_(3)
        assert torch.equal(shm.input_buffer("reg", 1000, torch.bfloat16, 128), b)  # the same memory
        assert torch.equal(g.all_reduce(b), b)
        with pytest.raises(UsageError, match=r"group 'reg'.*\(67108868 bytes\) at offset 0.*67108864 bytes"):
            g.input_buffer((16 << 20) + 1)
        with pytest.raises(UsageError, match="'reg'.*multiple of 64"):
            g.input_buffer(10, offset_bytes=32)
        with pytest.raises(ValueError, match="group 'reg'.*exceed the rank's input region of 67108864 bytes"):
            ops._shm_group_input_buffer("reg", 64 << 20, 1, torch.float32)
        ts = [torch.randn(3, 5), torch.randn(7), torch.randn(()), torch.randn(4, 3).t()]
        flat = torch.cat([t.reshape(-1) for t in ts])
        for offset in (0, 4096, (64 << 20) - 64):  # the last does not fit: cat + all_reduce
            assert torch.equal(ops.shm_wait(ops.shm_flatten_all_reduce_start(ts, offset, "sum", "reg")), flat)
        with pytest.raises(TypeError, match="one dtype"):
            ops.shm_flatten_all_reduce_start([torch.ones(2), torch.ones(2, dtype=torch.float16)], 0, "sum", "reg")
        meta = [torch.empty(4, 3, device="meta"), torch.empty(5, device="meta")]
        assert ops.shm_flatten_all_reduce_start(meta, 0, "sum", "reg").shape == (17,)
        g.destroy()
        assert torch.equal(b, torch.full((1000,), 3, dtype=torch.bfloat16))  # still mapped after the group is gone
    finally:
        dist.destroy_process_group()
