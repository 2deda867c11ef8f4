"""adaptdist.save_checkpoint / adaptdist.load_checkpoint for users of the torch.compile backend.

In one process (no process group, an uncompiled model): a round trip, optimizer state created on load, a
corrupt newest checkpoint skipped and named, a checkpoint of another model refused naming both. On gloo
ranks (slow): saved under fsdp (and dp) on 2 ranks, loaded on 3 ranks (fsdp before and after the first
compiled call, dp) and into an uncompiled model in this process: the parameters and the optimizer state
after the load equal the saved ones bitwise, and training on equals the uninterrupted 2-rank run to 1e-6.
The example script under torchrun --max-restarts 1, with rank 1 SIGKILLed once, resumes and ends equal to an
uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import adaptdist
from adaptdist.errors import CheckpointError
from adaptdist.runtime.launch import launch_local
from backend_checkpoint_workers import (load_then_other_model_worker, load_worker, make_model, make_optimizer,
                                        save_worker, snapshot, train_step)

SAVE_AT, STEPS = 3, 6
REPO = Path(__file__).resolve().parent.parent


def _assert_equal_snapshots(got: dict, want: dict, what: str) -> None:
    assert got["params"].keys() == want["params"].keys(), what
    for n, t in want["params"].items():
        assert torch.equal(got["params"][n], t), f"{what}: parameter {n}"
    assert got["state"].keys() == want["state"].keys(), what
    for n, st in want["state"].items():
        assert got["state"][n].keys() == st.keys(), f"{what}: state keys of {n}"
        for k, v in st.items():
            g = got["state"][n][k]
            assert (torch.equal(g, v) if isinstance(v, torch.Tensor) else g == v), f"{what}: state {n}.{k}"
    assert got["lr"] == want["lr"], what


def _assert_close_params(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    for n, t in want["params"].items():
        torch.testing.assert_close(got["params"][n], t, atol=atol, rtol=0, msg=f"{what}: parameter {n}")


# --- one process -----------------------------------------------------------------------------------------

def test_round_trip_creates_optimizer_state_and_restores_rng(tmp_path):
    model = make_model(0)
    opt = make_optimizer(model, "adamw")
    model.fc2.bias.requires_grad_(False)  # gets no gradient: AdamW keeps no state for it
    for s in range(2):
        train_step(model, opt, s, 0, 1)
    saved = snapshot(model, opt)
    assert "fc2.bias" not in [n for n, st in saved["state"].items() if st]
    torch.manual_seed(123)
    final = adaptdist.save_checkpoint(tmp_path, model, opt, step=2, extra={"epoch": 1})
    assert final == tmp_path / "step-00000002" and (final / "manifest.json").is_file()
    rng_after_save = torch.rand(3)

    other = make_model(5)
    other.fc2.bias.requires_grad_(False)
    other_opt = make_optimizer(other, "adamw")
    assert not other_opt.state  # built, no step taken
    other_opt.param_groups[0]["lr"] = 1.0
    assert adaptdist.load_checkpoint(tmp_path, other, other_opt) == (2, {"epoch": 1})
    _assert_equal_snapshots(snapshot(other, other_opt), saved, "round trip")
    assert other.fc2.bias not in other_opt.state or not other_opt.state[other.fc2.bias]
    assert torch.equal(torch.rand(3), rng_after_save)  # the RNG continues where the saver's was
    for s in range(2, 4):  # and training on is the same computation
        train_step(model, opt, s, 0, 1)
        train_step(other, other_opt, s, 0, 1)
    _assert_equal_snapshots(snapshot(other, other_opt), snapshot(model, opt), "trained on")


def test_no_checkpoint_is_none_and_bad_arguments_are_refused(tmp_path):
    model = make_model(0)
    assert adaptdist.load_checkpoint(tmp_path / "none", model) is None
    with pytest.raises(CheckpointError, match="integer step"):
        adaptdist.save_checkpoint(tmp_path, model, step=-1)
    with pytest.raises(CheckpointError, match="JSON-able"):
        adaptdist.save_checkpoint(tmp_path, model, step=1, extra={"t": torch.zeros(1)})
    adaptdist.save_checkpoint(tmp_path, model, step=1)  # no optimizer
    with pytest.raises(CheckpointError, match="no optimizer state"):
        adaptdist.load_checkpoint(tmp_path, model, make_optimizer(model, "sgd"))
    assert adaptdist.load_checkpoint(tmp_path, model) == (1, {})


def test_corrupt_newest_is_skipped_and_named_and_keep_prunes(tmp_path, caplog):
    model = make_model(0)
    opt = make_optimizer(model, "sgd")
    for s in range(3):
        train_step(model, opt, s, 0, 1)
        adaptdist.save_checkpoint(tmp_path, model, opt, step=s + 1, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    shard = next((tmp_path / "step-00000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    other = make_model(1)
    with caplog.at_level(logging.WARNING, logger="adaptdist.runtime.backend_checkpoint"):
        assert adaptdist.load_checkpoint(tmp_path, other, make_optimizer(other, "sgd"))[0] == 2
    assert any("step-00000003" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match="no checkpoint under .* is usable"):
        adaptdist.load_checkpoint(tmp_path, other, make_optimizer(other, "sgd"))


def test_checkpoint_of_another_model_is_refused_naming_both(tmp_path):
    model = make_model(0)
    adaptdist.save_checkpoint(tmp_path, model, make_optimizer(model, "sgd"), step=4)
    other = nn.Sequential(nn.Linear(12, 5))
    with pytest.raises(CheckpointError, match=r"written for model 'Small', not 'Sequential'"):
        adaptdist.load_checkpoint(tmp_path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="SGD optimizer, not of this AdamW"):
        adaptdist.load_checkpoint(tmp_path, model, make_optimizer(model, "adamw"))


# --- gloo ranks --------------------------------------------------------------------------------------------
# Every checkpoint the slow tests load is saved by one 2-rank launch (module-scoped: starting ranks costs
# seconds); the loads on 2 ranks and the refusal of another model share one more.

SUITE_TIMEOUT_S = 1500  # the first test to use the fixtures waits for their launches too


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("backend_checkpoints")
    return {k: str(base / k) for k in ("adamw_fsdp", "sgd_fsdp", "sgd_dp", "ep", "gpt_tp")}


def _saves(roots: dict[str, str]) -> list[dict]:
    return [dict(root=roots["adamw_fsdp"], plan="fsdp", opt="adamw", save_at=SAVE_AT, steps=STEPS),
            dict(root=roots["sgd_fsdp"], plan="fsdp", opt="sgd", save_at=SAVE_AT, steps=STEPS),
            dict(root=roots["sgd_dp"], plan="dp", opt="sgd", save_at=SAVE_AT, steps=STEPS),
            dict(root=roots["ep"], plan="ep", opt="sgd", save_at=2, steps=3, model="moe-list"),
            dict(root=roots["gpt_tp"], model="gpt", plan="tp", opt="sgd", save_at=2, steps=4, rows=4)]


@pytest.fixture(scope="module")
def saved_on_2(roots) -> dict:
    """{rank: save_worker's result per case of :func:`_saves`}."""
    return launch_local(save_worker, (_saves(roots),), 2)


@pytest.fixture(scope="module")
def loaded_on_2(roots, saved_on_2) -> dict:
    """{rank: (load_worker's result per ep case, the error of loading sgd_fsdp into another model)}."""
    ep = _saves(roots)[3]
    return launch_local(load_then_other_model_worker, ([dict(ep, order="after"), dict(ep, plan="dp", order="after")],
                                                       roots["sgd_fsdp"]), 2)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_save_on_2_ranks_load_on_3_and_1_under_other_plans(tmp_path, roots, saved_on_2, loaded_on_2):
    saves = _saves(roots)[:3]
    saved = {r: res[:3] for r, res in saved_on_2.items()}
    for k in range(len(saves)):  # both ranks saw the same full model
        _assert_equal_snapshots(saved[1][k]["saved"], saved[0][k]["saved"], f"save case {k}")
    assert saved[0][0]["saved"]["layouts"]["fc1.weight"] == [[[0, 4], [0, 12]], [[4, 7], [0, 12]]]  # uneven

    resaved = str(tmp_path / "resaved_on_3")
    loads = [dict(root=roots["adamw_fsdp"], plan="fsdp", opt="adamw", order="after", steps=STEPS, of=0,
                  save_to=resaved),
             dict(root=roots["adamw_fsdp"], plan="fsdp", opt="adamw", order="before", steps=STEPS, of=0),
             dict(root=roots["adamw_fsdp"], plan="dp", opt="adamw", order="after", steps=STEPS, of=0),  # fsdp -> dp
             dict(root=roots["sgd_fsdp"], plan="fsdp", opt="sgd", order="after", steps=STEPS, of=1),
             dict(root=roots["sgd_dp"], plan="fsdp", opt="sgd", order="after", steps=STEPS, of=2),  # dp -> fsdp
             dict(root=roots["sgd_dp"], plan="fsdp", opt="sgd", order="before", steps=STEPS, of=2)]
    loaded = launch_local(load_worker, (loads,), 3)
    for k, case in enumerate(loads):
        want = saved[0][case["of"]]
        for r in range(3):
            got = loaded[r][k]
            what = f"{case} rank {r}"
            assert (got["step"], got["extra"]) == (SAVE_AT, {"plan": saves[case["of"]]["plan"]}), what
            _assert_equal_snapshots(got["loaded"], want["saved"], what)
            _assert_close_params(got["final"], want["final"], what)  # 3 more steps on 3 ranks = on 2 ranks
        if case["plan"] == "fsdp" and case["order"] == "after":  # loaded into shards, one of them empty
            layouts = loaded[0][k]["loaded"]["layouts"]
            assert layouts["fc1.weight"][2] == [[6, 7], [0, 12]], layouts
            assert any(lo == hi for r in layouts.values() for box in r for lo, hi in box), layouts

    for k in range(len(saves)):  # world 1, no process group, an uncompiled model
        model = make_model(2)
        opt = make_optimizer(model, saves[k]["opt"])
        assert adaptdist.load_checkpoint(roots[list(roots)[k]], model, opt)[0] == SAVE_AT
        _assert_equal_snapshots(snapshot(model, opt), saved[0][k]["saved"], f"world 1, {saves[k]}")
        for s in range(SAVE_AT, STEPS):
            train_step(model, opt, s, 0, 1)
        _assert_close_params(snapshot(model, opt), saved[0][k]["final"], f"world 1, {saves[k]}")

    model = make_model(3)  # the 3 ranks' checkpoint (saved from shards, one of them empty), in one process
    opt = make_optimizer(model, "adamw")
    assert adaptdist.load_checkpoint(resaved, model, opt)[0] == STEPS
    _assert_equal_snapshots(snapshot(model, opt), loaded[0][0]["final"], "saved on 3 ranks, loaded on 1")

    errors = {r: res[1] for r, res in loaded_on_2.items()}
    for r in range(2):
        assert "CheckpointError" in errors[r] and "'Small'" in errors[r] and "'Sequential'" in errors[r], errors[r]


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_module_list_experts_under_ep_save_under_their_names_and_load_under_ep_dp_and_uncompiled(roots, saved_on_2,
                                                                                                  loaded_on_2):
    """ModuleList experts under ``ep`` (each rank holds 2 of 4 experts whole, the others empty): the checkpoint has
    each expert once under its own name (``moe.experts.3.fc.weight``), from the rank holding it; loaded on 2 ranks
    under ep and dp (after the first compiled call) and into an uncompiled model in this process, the parameters
    and momentum equal the saved ones bitwise, and training on equals the uninterrupted run."""
    root = roots["ep"]
    case = _saves(roots)[3]
    saved = {r: res[3:4] for r, res in saved_on_2.items()}
    layouts = saved[0][0]["saved"]["layouts"]
    assert layouts["moe.experts.0.fc.weight"] == [[[0, 32], [0, 16]], [[0, 0], [0, 16]]], layouts
    assert layouts["moe.experts.3.fc.bias"] == [[[0, 0]], [[0, 32]]], layouts
    loads = [dict(case, order="after"), dict(case, plan="dp", order="after")]
    loaded = {r: res[0] for r, res in loaded_on_2.items()}
    for k, load in enumerate(loads):
        for r in range(2):
            _assert_equal_snapshots(loaded[r][k]["loaded"], saved[0][0]["saved"], f"{load['plan']} rank {r}")
            _assert_close_params(loaded[r][k]["final"], saved[0][0]["final"], f"{load['plan']} rank {r}", atol=1e-5)
    model = make_model(2, "moe-list")
    opt = make_optimizer(model, "sgd")
    assert adaptdist.load_checkpoint(root, model, opt)[0] == 2
    _assert_equal_snapshots(snapshot(model, opt), saved[0][0]["saved"], "world 1")
    import torch.distributed.checkpoint as dcp

    where = next(Path(root).glob("step-*"))
    keys = set(dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata)
    assert "model/moe.experts.3.fc.weight" in keys and not any("*" in k for k in keys), sorted(keys)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_tensor_parallel_checkpoint_loads_on_a_2d_mesh_and_under_the_automatic_plan(roots, saved_on_2):
    """The GPT saved tensor-parallel on 2 ranks (attention and MLP weights sharded by heads / features), loaded
    on 4 ranks into a dp=2,tp=2 mesh (after the first call: shards of a 2-D layout) and under the automatic
    plan (before the first call), SGD with momentum: bitwise after the load, equal to the 2-rank run after."""
    root = roots["gpt_tp"]
    saved = saved_on_2[0][4]
    assert saved["saved"]["layouts"]["blocks.0.attn.q.weight"] == [[[0, 16], [0, 32]], [[16, 32], [0, 32]]]
    loads = [dict(root=root, model="gpt", plan="dp,tp", mesh="dp=2,tp=2", opt="sgd", order="after", steps=4, rows=4),
             dict(root=root, model="gpt", plan="auto", opt="sgd", order="before", steps=4, rows=4)]
    loaded = launch_local(load_worker, (loads,), 4)
    for k, case in enumerate(loads):
        for r in range(4):
            what = f"{case['plan']} rank {r}"
            _assert_equal_snapshots(loaded[r][k]["loaded"], saved["saved"], what)
            _assert_close_params(loaded[r][k]["final"], saved["final"], what)
    layouts = loaded[0][0]["loaded"]["layouts"]  # tp-sharded, replicated over dp: ranks 0 and 2 hold one box
    assert layouts["blocks.0.attn.q.weight"] == [[[0, 16], [0, 32]], [[16, 32], [0, 32]]] * 2, layouts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, env_extra: dict, steps: int, every: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
           "--monitor-interval", "0.5", str(REPO / "examples" / "elastic_backend.py"), "--steps", str(steps),
           "--checkpoint-every", str(every), "--out", str(out), "--plan", "fsdp", "--seq-len", "32"]
    return subprocess.run(cmd, env=env, cwd=str(out.parent), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_example_under_torchrun_resumes_after_a_sigkill(tmp_path):
    """Rank 1 of the example kills itself (SIGKILL) at step 7 of its first attempt; torchrun restarts both
    ranks, which resume from the checkpoint of step 6 and end with the parameters of a run never killed."""
    steps, every = 10, 3
    clean = _torchrun(tmp_path / "clean", {}, steps, every)
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = _torchrun(tmp_path / "killed", {"ADAPTDIST_TEST_KILL_AT_STEP": "7"}, steps, every)
    assert killed.returncode == 0, killed.stderr[-3000:]
    log = killed.stdout + killed.stderr
    assert "killing itself" in log and "resumed from step 6" in log, log[-3000:]
    assert "resumed from" not in clean.stdout + clean.stderr
    a = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # same plan and world size: bitwise
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["resumed_from"] == 6 and summary["steps"] == steps
