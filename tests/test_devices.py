"""runtime/devices.py: each rank's device and the process-group backend, decided from the cluster (no GPU needed);
the typed errors a cuda rank gets where there is no such device."""

import pytest
import torch

from adaptdist.calibrate.local import estimated_cluster, local_cluster
from adaptdist.errors import ClusterSpecError, DeviceUnavailableError
from adaptdist.runtime.devices import (RankDevice, bind_device, check_device, from_exchange, process_group_backend,
                                       rank_devices, to_exchange)


def test_backend_of_each_kind_mix():
    assert process_group_backend(["cpu", "cpu"]) == "gloo"
    # all-cuda keeps gloo for the runtime's CPU tensors; mixed sends CPU tensors through gloo, CUDA through nccl
    assert process_group_backend(["cuda"]) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(["cpu", "cuda"]) == "cpu:gloo,cuda:nccl"
    with pytest.raises(ClusterSpecError, match="tpu"):
        process_group_backend(["cpu", "tpu"])
    with pytest.raises(ClusterSpecError):
        process_group_backend([])


def test_cuda_indices_count_per_host_and_skip_cpu_ranks():
    # host a: cpu ranks 0, 1 then cuda ranks 2, 3; host b: cuda ranks 4, 5
    cluster = estimated_cluster((("a", "cpu", 2), ("a2", "cuda", 2), ("b", "cuda", 2)))
    devs = rank_devices(cluster)
    assert [d.name for d in devs] == ["cpu", "cpu", "cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [d.host for d in devs] == ["a", "a", "a2", "a2", "b", "b"]
    assert devs[3].torch_device == torch.device("cuda", 1)
    assert process_group_backend(d.kind for d in devs) == "cpu:gloo,cuda:nccl"


def test_rank_mapping_moves_devices():
    cluster = estimated_cluster((("h", "cuda", 2), ("c", "cpu", 1)))
    # program rank 0 on cluster device 2 (cpu), rank 1 on device 1 (cuda:1), rank 2 on device 0 (cuda:0)
    assert [d.name for d in rank_devices(cluster, (2, 1, 0))] == ["cpu", "cuda:1", "cuda:0"]


def test_all_cpu_cluster_is_unchanged():
    devs = rank_devices(local_cluster(3))
    assert [d.torch_device for d in devs] == [torch.device("cpu")] * 3
    assert bind_device(devs[1]) == torch.device("cpu")


def test_cuda_rank_without_cuda_names_rank_host_device():
    dev = RankDevice(3, "gpu0", "cuda", 1)
    with pytest.raises(DeviceUnavailableError, match=r"rank 3 \(host 'gpu0', device cuda:1\).*sees no CUDA"):
        check_device(dev, cuda_available=False, cuda_count=0)
    with pytest.raises(DeviceUnavailableError, match=r"rank 3 .*has 1 CUDA device\(s\)"):
        check_device(dev, cuda_available=True, cuda_count=1)
    check_device(dev, cuda_available=True, cuda_count=2)  # index 1 of 2 exists


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_bind_cuda_without_cuda_is_typed():
    with pytest.raises(DeviceUnavailableError, match="rank 0"):
        bind_device(rank_devices(local_cluster(1, "cuda"))[0])


def test_exchange_is_cpu_and_contiguous():
    t = torch.arange(6.0).reshape(2, 3).t()
    out = to_exchange(t)
    assert out.device.type == "cpu" and out.is_contiguous() and torch.equal(out, t)
    assert from_exchange(out, torch.device("cpu")) is out


def test_program_on_device_retargets_code_and_runs(tmp_path):
    """A rank program captured on cpu, moved to another device ("meta" stands in for cuda:I here): every device
    argument in its code names that device, and the step runs there with no tensor left behind on cpu."""
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.program import load_program, save_programs
    from adaptdist.runtime.devices import program_on_device, retarget_code
    from models import tiny_gpt

    assert retarget_code("a(device = device(type='cuda', index=0))", torch.device("cuda", 3)) == \
        "a(device = device(type='cuda', index=3))"
    model, batch, loss_fn = tiny_gpt()
    save_programs(compile_model(model, batch, loss_fn, 1), tmp_path)
    program = load_program(tmp_path, 0, world_size=1)
    assert "device(type='cpu')" in program.code  # the position ids' arange
    moved = program_on_device(program, torch.device("meta"))
    assert "device(type='cpu')" not in moved.code and "device(type='meta')" in moved.code
    outs = moved(*[program.state[f].to("meta") for f in program.input_fqns], *[t.to("meta") for t in batch])
    assert {o.device.type for o in outs} == {"meta"}
    # on cpu the copy computes what the program does
    same = program_on_device(program, torch.device("cpu"))
    args = [program.state[f] for f in program.input_fqns] + list(batch)
    for a, b in zip(program(*args), same(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what `train` says on a machine without CUDA")
def test_train_cuda_cluster_without_cuda_names_the_rank(tmp_path, capsys):
    from adaptdist.cli import main

    f = tmp_path / "gpu.yaml"
    f.write_text("schema_version: 1\nhosts:\n  - {name: localhost, device_kind: cuda, num_devices: 1}\n")
    code = main(["train", "--cluster", str(f), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert "rank 0 (host 'localhost', device cuda:0)" in " ".join(err.split()), err


def test_mixed_cluster_devices_and_comm_shm_refused():
    import argparse

    from adaptdist.cli.common import lowering_options
    from adaptdist.cli.train import _devices_of_rank
    from adaptdist.errors import UsageError

    mixed = estimated_cluster((("localhost", "cpu", 2), ("gpu", "cuda", 1)))
    assert [d.name for d in _devices_of_rank(mixed, None)] == ["cpu", "cpu", "cuda:0"]
    assert _devices_of_rank(local_cluster(2), None) == ()  # all-cpu: the worker's default, as before
    with pytest.raises(UsageError, match="--comm shm"):
        lowering_options(argparse.Namespace(comm="shm"), mixed)
    assert lowering_options(argparse.Namespace(comm="auto"), mixed).comm == "auto"


def test_costing_a_program_captured_on_cuda(tmp_path):
    """The cost model runs a cuda job's program on fake cuda tensors (no GPU needed): the program's device arguments
    (its arange's) and its inputs agree, both for a compiled graph (placeholders' values on cuda) and for a loaded
    one (re-traced from code naming cuda). Costing used to build every input on cpu: FakeTensorDeviceMismatchError."""
    import dataclasses

    from adaptdist import _torch_compat as compat
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.cost_models.schedule import build_schedule, schedule_from_graph
    from adaptdist.program import code_device, module_from_source
    from adaptdist.runtime.devices import retarget_code
    from models import tiny_gpt

    def step(x):  # an arange on the input's device, as position ids are
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)

    gm = compat.trace_fake(step, [([2, 3], torch.float32)], "cuda")
    assert next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].device.type == "cuda"
    assert len(schedule_from_graph(gm, ["batch:0"], ["out"]).nodes) == len(gm.graph.nodes)

    model, batch, loss_fn = tiny_gpt()
    program = compile_model(model, batch, loss_fn, 1)[0]
    code = retarget_code(program.code, torch.device("cuda", 0))
    assert code_device(code) == torch.device("cuda", 0) and code_device(program.code) == torch.device("cpu")
    on_cuda = dataclasses.replace(program, code=code, module=module_from_source(code, "<cuda>"), _traced=None)
    assert {n.meta["val"].device.type for n in on_cuda.graph_module.graph.find_nodes(op="placeholder")} == {"cuda"}
    assert len(build_schedule(on_cuda).nodes) == len(build_schedule(program).nodes)
