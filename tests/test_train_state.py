"""Training state in a checkpoint directory (runtime/train_state.py): saved through DCP on some world size,
mesh and plan, loaded resharded onto others, bitwise; optimizer state included, created where the optimizer
has none yet and absent for a parameter that had none; replicas checked identical; another model and a
truncated file refused."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from adaptdist.annotations import ManualPlan
from adaptdist.state_layout import shard_layout
from adaptdist.compiler.lowering import compile_model
from adaptdist.errors import CheckpointError
from adaptdist.program import save_programs
from adaptdist.runtime import checkpoint_store
from adaptdist.runtime.launch import launch_local
from adaptdist.runtime.train_state import load_train_state, state_shapes

LR = 0.05
TP = (("fc1.weight", "S(0)"), ("fc1.bias", "S(0)"), ("fc2.weight", "S(1)"))


class MLP6(nn.Module):
    """12 -> 6 -> 5: under fsdp on 4 ranks fc1's 6 rows are chunked 2, 2, 2, 0 (one shard empty) and fc2's 5
    rows 2, 2, 1, 0."""

    def __init__(self, hidden: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(12, hidden)
        self.fc2 = nn.Linear(hidden, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(12, 12, generator=g), torch.randint(0, 5, (12,), generator=g)) for _ in range(n)]


def _plan(name: str, mesh: str | None):
    if name == "dp":
        return ManualPlan.parse("dp"), None
    if name == "fsdp":
        return ManualPlan.parse("fsdp"), None
    if name == "tp":
        return ManualPlan("tp", ("tp",), None, tuple((g, (p,)) for g, p in TP)), None
    if name == "nested":  # fc1's rows chunked by tp, then by dp (lowering order, not the mesh's)
        return ManualPlan("nested", ("dp", "tp"), "dp", (("fc1.weight", ("S(0)", "S(0)")),
                                                         ("fc1.bias", ("S(0)", "S(0)")),
                                                         ("fc2.weight", ("S(1)", "S(1)")))), mesh
    assert name == "dp,tp"
    return ManualPlan("dp,tp", ("dp", "tp"), "dp", tuple((g, ("R", p)) for g, p in TP)), mesh


def _compile(tmp_path, world: int, plan: str, mesh: str | None = None, weights: dict | None = None) -> tuple:
    model = MLP6()
    if weights is not None:
        with torch.no_grad():
            for f, t in model.named_parameters():
                t.copy_(weights[f])
    p, m = _plan(plan, mesh)
    progs = compile_model(model, _batches()[0], F.cross_entropy, world, p, mesh=m)
    d = tmp_path / f"programs-{world}-{plan.replace(',', '')}-{mesh or ''}-{weights is not None}"
    save_programs(progs, d)
    return str(d), progs


def _slice(full: torch.Tensor, ranges: list[list[int]]) -> torch.Tensor:
    return full[tuple(slice(s, e) for s, e in ranges)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints after 2 AdamW steps on 4 ranks under fsdp, dp and dp=2,tp=2 (fc2.bias's optimizer state
    removed: a parameter without gradient), and after 3 SGD steps under fsdp; the fsdp AdamW one once more
    saved asynchronously, with a step taken while it is written."""
    tmp = tmp_path_factory.mktemp("saved")
    cases, out = [], {}
    for plan, mesh, opt, steps in (("fsdp", None, "adamw", 2), ("dp", None, "adamw", 2),
                                   ("dp,tp", "dp=2,tp=2", "adamw", 2), ("nested", "dp=2,tp=2", "adamw", 2),
                                   ("fsdp", None, "sgd", 3), ("fsdp", None, "adamw-async", 2)):
        d, progs = _compile(tmp, 4, plan, mesh)
        root = tmp / f"ckpt-{plan.replace(',', '')}-{opt}"
        cases.append({"program_dir": d, "optimizer": opt.split("-")[0], "lr": LR, "batches": _batches(),
                      "steps": steps, "drop": ["fc2.bias"] if opt != "sgd" else [], "root": str(root),
                      "name": "MLP6", "async": opt.endswith("-async")})
        out[(plan, opt)] = root
    assert shard_layout(progs[3])["fc1.bias"]["ranges"] == [[6, 6]]  # the empty shard
    res = launch_local(_train_state_workers().save_worker, (cases,), 4)
    from safetensors.torch import load_file

    return {k: {"dir": checkpoint_store.step_dir(root, 3 if k[1] == "sgd" else 2),
                "full": load_file(str(root / "full.safetensors")),
                "rng": {r: res[r][i]["rng"] for r in res}, "save_s": max(res[r][i]["save_s"] for r in res)}
            for i, (k, root) in enumerate(out.items())}


def _train_state_workers():
    import train_state_workers

    return train_state_workers


def _check_exact(progs: dict, res: dict, i: int, src: dict, with_adam: bool = True,
                 dropped: str = "fc2.bias") -> None:
    """Every rank's state and optimizer state after case ``i``'s load equal, bitwise, its slice of the
    saver's full tensors; ``dropped`` has no optimizer state; RNG restored from the same rank's file."""
    full = src["full"]
    for r, prog in progs.items():
        got = res[r][i]
        layout = shard_layout(prog)
        for f in prog.input_fqns:
            want = _slice(full[f"model/{f}"], layout[f]["ranges"])
            assert torch.equal(got["state"][f], want), (r, f)
            if f in got["params"]:
                assert torch.equal(got["params"][f], want), (r, f)  # loaded in place: the optimizer's tensors
        if not with_adam:
            continue
        assert dropped not in got["optim"], r  # no state in the checkpoint: none after loading
        for f in prog.param_fqns:
            if f == dropped:
                continue
            st = got["optim"][f]
            assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"], (r, f)
            assert torch.equal(st["step"], full[f"optim/{f}/step"]), (r, f)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], _slice(full[f"optim/{f}/{k}"], layout[f]["ranges"])), (r, f, k)
        if r in src["rng"]:
            assert torch.equal(got["rng"], src["rng"][r]), r


RESHARD_ON_3 = [("fsdp", None, ("fsdp", "adamw"), True), ("dp", None, ("fsdp", "adamw"), False),
                ("fsdp", None, ("dp", "adamw"), False), ("tp", None, ("dp,tp", "adamw"), False),
                ("fsdp", None, ("nested", "adamw"), False), ("fsdp", None, ("fsdp", "adamw-async"), False)]


@pytest.fixture(scope="module")
def loaded_on_3(tmp_path_factory, saved) -> dict:
    """One 3-rank launch (starting ranks costs seconds) for both tests that load on 3 ranks: the cases of
    RESHARD_ON_3 (case 1's replica corrupted after its check), then the two SGD cases of
    test_sgd_resumed_on_another_world_size_equals_uninterrupted. {"reshard": (results, programs), "sgd": (results,
    programs, weights)}, results as {rank: [case results]}."""
    tmp = tmp_path_factory.mktemp("on_3")
    cases, progs = _cases(tmp, saved, 3, RESHARD_ON_3, corrupt=(1, 1))
    sgd_cases, sgd_progs, weights = _sgd_resume_cases(tmp, saved)
    res = launch_local(_train_state_workers().load_worker, (cases + sgd_cases,), 3)
    n = len(cases)
    return {"reshard": ({r: v[:n] for r, v in res.items()}, progs),
            "sgd": ({r: v[n:] for r, v in res.items()}, sgd_progs, weights)}


@pytest.mark.slow
def test_fsdp_on_4_loads_resharded_on_3_exactly(saved, loaded_on_3):
    """4 -> 3 ranks: fsdp -> fsdp (optimizer already holding state, fc2.bias's included), fsdp -> dp,
    dp -> fsdp, dp=2,tp=2 -> tp=3, fc1 sharded on both axes of dp=2,tp=2 (lowering-order mesh) -> fsdp, the
    async save (what was staged at the call, not the state of the step taken while it was written) -> fsdp. Then
    one replica of fc2.bias off by one ulp under dp: every rank refuses, naming the state and the ranks."""
    res, progs = loaded_on_3["reshard"]
    _check_cases(res, RESHARD_ON_3, progs, saved, corrupt=(1, 1))
    for r in res:
        assert res[r][1]["refused"] is not None, r
        assert "CheckpointError: replicas are not identical" in res[r][1]["refused"]
        assert "state 'fc2.bias' differs across mesh axis 'dp': ranks [0, 2] vs [1]" in res[r][1]["refused"]


@pytest.mark.slow
def test_fsdp_on_4_loads_resharded_on_6_and_1_exactly(tmp_path, saved):
    """4 -> 6 ranks (fsdp -> fsdp: fc2.bias [5] now replicated, fc2.weight sharded on dim 1; fsdp ->
    dp=2,tp=3; dp=2,tp=2 -> fsdp; fsdp -> fc1 sharded on both axes of dp=3,tp=2) and 4 -> 1 (fsdp -> dp)."""
    specs = [("fsdp", None, ("fsdp", "adamw"), False), ("dp,tp", "dp=2,tp=3", ("fsdp", "adamw"), True),
             ("fsdp", None, ("dp,tp", "adamw"), False), ("nested", "dp=3,tp=2", ("fsdp", "adamw"), False)]
    _load_and_check(tmp_path, saved, 6, specs)
    _load_and_check(tmp_path, saved, 1, [("dp", None, ("fsdp", "adamw"), False)])


def _load_and_check(tmp_path, saved, world: int, specs: list, corrupt: tuple[int, int] | None = None) -> dict:
    """Load each spec (plan, mesh, source checkpoint key, prefill) on ``world`` ranks and check it exactly;
    ``corrupt``: (case, rank) whose replica of fc2.bias is perturbed after the check."""
    cases, progs = _cases(tmp_path, saved, world, specs, corrupt)
    res = launch_local(_train_state_workers().load_worker, (cases,), world)
    _check_cases(res, specs, progs, saved, corrupt)
    return res


def _cases(tmp_path, saved, world: int, specs: list, corrupt: tuple[int, int] | None = None) -> tuple[list, list]:
    """load_worker's cases of ``specs`` (programs compiled for ``world`` ranks) and the programs."""
    cases, progs = [], []
    for plan, mesh, src, prefill in specs:
        d, p = _compile(tmp_path, world, plan, mesh)
        progs.append(p)
        cases.append({"program_dir": d, "optimizer": "adamw", "lr": LR, "checkpoint": str(saved[src]["dir"]),
                      "prefill": prefill, "batches": _batches(), "name": "MLP6"})
    if corrupt is not None:
        cases[corrupt[0]]["corrupt_rank"] = corrupt[1]
    return cases, progs


def _check_cases(res: dict, specs: list, progs: list, saved, corrupt: tuple[int, int] | None = None) -> None:
    for i, (spec, p) in enumerate(zip(specs, progs)):
        _check_exact(p, res, i, saved[spec[2]])
        if corrupt is None or corrupt[0] != i:
            assert all(res[r][i]["refused"] is None for r in res)


def _sgd_resume_cases(tmp_path, saved) -> tuple[list, list, dict]:
    """Resumed: the 4-rank fsdp SGD checkpoint loaded under dp on 3 ranks, 3 more steps; fresh: 3 steps on 3
    ranks from the saved weights, no load. (cases, the resumed case's programs, the saved weights)"""
    src = saved[("fsdp", "sgd")]
    weights = {k[len("model/"):]: v for k, v in src["full"].items() if k.startswith("model/")}
    d, progs = _compile(tmp_path, 3, "dp")
    ref_dir, _ = _compile(tmp_path, 3, "dp", weights=weights)
    batches = _batches()
    cases = [{"program_dir": d, "optimizer": "sgd", "lr": LR, "checkpoint": str(src["dir"]), "batches": batches,
              "steps": 3, "name": "MLP6"},
             {"program_dir": ref_dir, "optimizer": "sgd", "lr": LR, "checkpoint": None, "batches": batches,
              "steps": 3, "name": "MLP6"}]
    return cases, progs, weights


@pytest.mark.slow
def test_sgd_resumed_on_another_world_size_equals_uninterrupted(saved, loaded_on_3):
    """3 SGD steps on 4 ranks (fsdp), saved, loaded on 3 ranks (dp), 3 more steps: equal (1e-6) to 3 steps on
    3 ranks from the saved state, and to single-process eager SGD from it; the loss curve has no jump."""
    src = saved[("fsdp", "sgd")]
    res, progs, weights = loaded_on_3["sgd"]
    batches = _batches()
    _check_exact(progs, res, 0, src, with_adam=False)
    model = MLP6()
    with torch.no_grad():
        for f, t in model.named_parameters():
            t.copy_(weights[f])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    eager_losses = []
    for s in range(3):
        x, y = batches[s % len(batches)]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        eager_losses.append(loss.item())
    for r in res:
        resumed, fresh = res[r][0], res[r][1]
        assert resumed["losses"] == pytest.approx(fresh["losses"], abs=1e-6)
        assert resumed["losses"] == pytest.approx(eager_losses, abs=1e-6)
        for f, t in model.named_parameters():
            torch.testing.assert_close(resumed["after"][f], fresh["after"][f], atol=1e-6, rtol=0)
            torch.testing.assert_close(resumed["after"][f], t.detach(), atol=1e-6, rtol=0)


@pytest.mark.slow  # uses the checkpoints of the 4-rank fixture
def test_checkpoint_of_another_model_is_refused(tmp_path, saved):
    """A model with 7 hidden units instead of 6: refused before DCP reads anything, naming both models and
    the first state that differs."""
    model = MLP6(hidden=7)
    progs = compile_model(model, _batches()[0], F.cross_entropy, 1, ManualPlan.parse("dp"))
    prog = progs[0]
    state = {f: t.clone() for f, t in prog.state.items()}
    opt = torch.optim.AdamW([state[f] for f in prog.param_fqns])
    with pytest.raises(CheckpointError, match=r"written for model 'MLP6', not 'MLP7'.*fc1\.bias is \[6\] there "
                                               r"but \[7\] here"):
        load_train_state(saved[("fsdp", "adamw")]["dir"], prog, state, opt, None, 0, restore_rng=False,
                         model="MLP7")
    assert state_shapes(prog)["fc1.weight"] == [7, 12]
    # without state_shapes in meta.json (and not verified): DCP's own metadata refuses it, naming the state
    bare = tmp_path / "bare"
    shutil.copytree(saved[("fsdp", "adamw")]["dir"], bare)
    (bare / checkpoint_store.META_NAME).write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match=r"bare'.*state 'fc1\.weight' has global shape \[6, 12\] there, "
                                              r"\[7, 12\] here"):
        load_train_state(bare, prog, state, opt, None, 0, restore_rng=False, verify=False)


@pytest.mark.slow  # uses the checkpoints of the 4-rank fixture
def test_truncated_shard_file_is_refused_before_dcp_reads_it(tmp_path, saved):
    src = saved[("fsdp", "adamw")]["dir"]
    bad = tmp_path / src.name
    shutil.copytree(src, bad)
    shard = sorted((bad / "dcp").glob("*.distcp"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*has {len(data) // 2} bytes, its manifest says "
                                              rf"{len(data)}"):
        checkpoint_store.verify(bad)
    prog = compile_model(MLP6(), _batches()[0], F.cross_entropy, 1, ManualPlan.parse("dp"))[0]
    state = {f: t.clone() for f, t in prog.state.items()}
    before = {f: t.clone() for f, t in state.items()}
    opt = torch.optim.AdamW([state[f] for f in prog.param_fqns])
    with pytest.raises(CheckpointError, match="truncated"):
        load_train_state(bad, prog, state, opt, None, 0, restore_rng=False)
    assert all(torch.equal(state[f], before[f]) for f in state) and not opt.state


@pytest.mark.slow
def test_gpt_fsdp_on_2_loads_as_tp_on_2_and_dp_on_3(tmp_path):
    """The tiny GPT (tied embedding and head, attention heads split by tp): 2 AdamW steps under fsdp on 2
    ranks (pos_emb.weight without optimizer state), loaded under tp on 2 ranks (the optimizer already holding
    state) and under dp on 3, exactly."""
    import adaptdist.models.gpt as gpt_module
    from safetensors.torch import load_file

    from models import tiny_gpt

    model, batch, loss_fn = tiny_gpt(batch_size=6)
    progs = {}
    for world, plan in ((2, "fsdp"), (2, "tp"), (3, "dp")):
        m, _, _ = tiny_gpt(batch_size=6)
        progs[(world, plan)] = compile_model(m, batch, loss_fn, world, ManualPlan.parse(plan, gpt_module))
        save_programs(progs[(world, plan)], tmp_path / f"gpt-{world}-{plan}")
    root = tmp_path / "ckpt"
    dropped = "pos_emb.weight"
    assert dropped in progs[(2, "fsdp")][0].param_fqns
    w = _train_state_workers()
    res = launch_local(w.save_worker, ([{"program_dir": str(tmp_path / "gpt-2-fsdp"), "optimizer": "adamw",
                                         "lr": LR, "batches": [batch], "steps": 2, "drop": [dropped],
                                         "root": str(root), "name": "gpt"}],), 2)
    src = {"dir": checkpoint_store.step_dir(root, 2), "full": load_file(str(root / "full.safetensors")),
           "rng": {r: res[r][0]["rng"] for r in res}}
    for world, plan, prefill in ((2, "tp", True), (3, "dp", False)):
        case = {"program_dir": str(tmp_path / f"gpt-{world}-{plan}"), "optimizer": "adamw", "lr": LR,
                "checkpoint": str(src["dir"]), "prefill": prefill, "batches": [batch], "name": "gpt"}
        got = launch_local(w.load_worker, ([case],), world)
        _check_exact(progs[(world, plan)], got, 0, src, dropped=dropped)
