"""The execution mode of a recommender (issue 17): the cost model of both modes (adaptdist/cost_models/recsys.py),
the planner's choice (adaptdist/compiler/planner/modes.py) and the commands' flags (adaptdist/cli/modes.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from adaptdist.calibrate.local import load_cluster
from adaptdist.compiler.planner.modes import choose_mode, recsys_shape
from adaptdist.cost_models.hardware import FixedCluster
from adaptdist.cost_models.recsys import (LOCAL_GLOO_P2P_ALPHA_S, LOCAL_GLOO_P2P_BETA_S_PER_BYTE, RecsysShape,
                                         async_cost, gathered_tables, sync_comm_s, sync_cost)
from adaptdist.data import movielens as ml
from adaptdist.errors import UsageError
from adaptdist.models import dlrm

ROOT = Path(__file__).resolve().parents[1]
CPU_GPU = ROOT / "benchmarks" / "clusters" / "cpu_hosts_and_gpus.yaml"
SHAPE = RecsysShape(table_rows=(610, 9742, 21), dim=32, ids_per_row=(1, 1, 10), dense_flops_per_row=2e4,
                    dense_bytes_per_row=2e3, dense_params=9000, dense_ops=60, batch_size=256, optimizer="sgd")


def test_recsys_shape_of_builtin_dlrm():
    data = ml.generate(num_users=40, num_movies=60, num_genres=6, num_ratings=300, max_genres=3)
    torch.manual_seed(0)
    model = dlrm.rating_model(data.num_users, data.num_movies, data.num_genres, 3.5)
    batch = data.rows(torch.arange(16))
    shape = recsys_shape(model, batch, "adamw")
    assert shape.table_rows == (40, 60, 7) and shape.dim == 32 and shape.ids_per_row == (1, 1, 3)
    assert shape.dense_params == sum(p.numel() for p in model.dense_arch.parameters())
    # the top MLP's matmuls, 2 FLOPs per multiply-add: (99*64 + 64*32 + 32) per row at least
    assert shape.dense_flops_per_row >= 2 * (99 * 64 + 64 * 32 + 32)
    assert 10 < shape.dense_ops < 500 and shape.batch_size == 16


def test_the_cost_model_by_hand():
    """Two ranks, one sparse (all tables) and one dense, staleness 1: the step is the slower side's; staleness 0 the
    round trip; sync's all_reduce on shared memory is cheaper than on gloo's link; AdamW's sparse update adds the
    shard's materialized gradient and its passes."""
    c = FixedCluster.uniform([("h", 2)], "cpu", memory_bandwidth_bytes_per_s=1e10, op_overhead_s=1e-5)
    shard_rows = [[(0, 610), (1, 9742), (2, 21)], []]
    cost = async_cost(SHAPE, c, ("sparse", "dense"), shard_rows, 1)
    lookups = 3 * 32 * 4 * 256 * (1 + 1 + 10) / 1e10 + 3 * (12 + 12) * 1e-5  # lookups, then the sparse SGD update
    assert cost.rank_s[0] == pytest.approx(lookups)
    # an uncalibrated pair of one host: the measured loopback gloo figures, not the link's estimated latency
    msg = LOCAL_GLOO_P2P_ALPHA_S + 256 * 3 * 32 * 4 * LOCAL_GLOO_P2P_BETA_S_PER_BYTE
    assert cost.comm_s[0] == pytest.approx(2 * msg)
    assert cost.step_s == pytest.approx(max(cost.rank_s[0] + cost.comm_s[0], cost.rank_s[1] + cost.comm_s[1]))
    serial = async_cost(SHAPE, c, ("sparse", "dense"), shard_rows, 0)
    # K=0: the sparse side, then the dense forward + backward and the messages; the dense optimizer step overlaps
    dense_opt = SHAPE.dense_params * 12 / 1e10 + 1 * 1e-5
    assert serial.step_s == pytest.approx(cost.rank_s[0] + cost.rank_s[1] - dense_opt + cost.comm_s[1])
    assert serial.step_s > cost.step_s
    sync = sync_cost(SHAPE, c, shm=False)
    assert sync.comm_s[0] > 0 and sync.step_s == pytest.approx(max(sync.rank_s) + sync.comm_s[0])
    assert sync_cost(SHAPE, c, shm=True).comm_s[0] < sync.comm_s[0]
    assert cost.items_per_s == pytest.approx(256 / cost.step_s)
    import dataclasses

    adamw = async_cost(dataclasses.replace(SHAPE, optimizer="adamw"), c, ("sparse", "dense"), shard_rows, 1)
    held = (610 + 9742 + 21) * 32
    assert adamw.rank_s[0] == pytest.approx(lookups + 2 * held * 4 / 1e10 + held * 28 / 1e10 + 3 * 10 * 1e-5)


def test_sync_gathers_the_big_tables_rows_and_all_reduces_the_rest():
    """As passes/gather_embedding_rows.py lowers builtin:dlrm: users (610 x 32) and movies (9,742 x 32) are built from
    the batch's gathered rows, the genres' 21-row table (below 64 KiB) stays in the all_reduce bucket; one rank
    gathers nothing. The comm is the loss's and the bucket's all_reduces plus one all_gather of both tables' rows and
    ids (ids as float32 values: passes/bucket_gathered_rows.py); a table of more than 2**24 rows sends its int64 ids
    in a second all_gather."""
    from adaptdist.cost_models.communication import collective_time_s, link_cost
    from adaptdist.cost_models.recsys import all_reduce_s

    assert gathered_tables(SHAPE, 2) == (True, True, False)
    assert gathered_tables(SHAPE, 1) == (False, False, False)
    big_batch = RecsysShape(**{**SHAPE.__dict__, "batch_size": 100_000})  # more rows than the tables: all-reduced
    assert gathered_tables(big_batch, 2) == (False, False, False)
    c = FixedCluster.uniform([("h", 2)], "cpu", memory_bandwidth_bytes_per_s=1e10, op_overhead_s=1e-5)
    ag = link_cost(c, "all_gather", [0, 1])
    gathers = collective_time_s("all_gather", 2 * 256 * (32 * 4 + 4), 2, ag.alpha_s, ag.beta_s_per_byte)
    want = all_reduce_s(c, [0, 1], 4) + all_reduce_s(c, [0, 1], (9000 + 21 * 32) * 4) + gathers
    assert sync_comm_s(SHAPE, c, [0, 1], shm=False) == pytest.approx(want)
    huge = RecsysShape(**{**SHAPE.__dict__, "table_rows": (610, 2**24 + 1, 21)})
    assert gathered_tables(huge, 2) == (True, True, False)
    apart = (collective_time_s("all_gather", 256 * (2 * 32 * 4 + 4), 2, ag.alpha_s, ag.beta_s_per_byte)
             + collective_time_s("all_gather", 256 * 8, 2, ag.alpha_s, ag.beta_s_per_byte))
    assert sync_comm_s(huge, c, [0, 1], shm=False) == pytest.approx(
        all_reduce_s(c, [0, 1], 4) + all_reduce_s(c, [0, 1], (9000 + 21 * 32) * 4) + apart)
    dense_all = all_reduce_s(c, [0, 1], (9000 + SHAPE.table_params) * 4)
    assert sync_comm_s(SHAPE, c, [0, 1], shm=False) < dense_all  # the old price: the whole tables on gloo
    dense_shm = all_reduce_s(c, [0, 1], (9000 + SHAPE.table_params) * 4, shm=True)
    assert sync_comm_s(SHAPE, c, [0, 1], shm=True) < dense_shm / 3  # on the shared-memory kernels
    assert sync_cost(SHAPE, c, [0]).comm_s == (0.0,)


def test_one_rank_is_reported_never_chosen():
    """A shape so small that no collective pays: one rank alone is predicted faster than both modes; auto still
    picks among the modes on the job's ranks and mode_lines says one rank would be faster."""
    from adaptdist.compiler.planner.modes import mode_lines

    tiny = RecsysShape(table_rows=(8, 8), dim=4, ids_per_row=(1, 1), dense_flops_per_row=10.0, dense_bytes_per_row=10.0,
                       dense_params=50, dense_ops=5, batch_size=8, optimizer="sgd")
    c = FixedCluster.uniform([("h", 2)], "cpu", memory_bandwidth_bytes_per_s=1e10, op_overhead_s=1e-5)
    choice = choose_mode(tiny, c, "auto", 1)
    assert choice.mode in ("sync", "async-hetero") and choice.one_rank is not None
    assert choice.one_rank_faster and choice.one_rank.step_s < min(x.step_s for x in choice.candidates.values())
    assert any("one rank alone" in line and "gains nothing from 2 ranks" in line for line in mode_lines(choice))
    assert choice.describe()["one_rank"]["faster_than_chosen"] is True
    # the recommender of the other tests on the same cluster: the modes beat one rank, and the line says so
    real = choose_mode(SHAPE, c, "auto", 1)
    assert not real.one_rank_faster
    assert any("slower than the chosen mode" in line for line in mode_lines(real))


def test_queue_messages_take_the_calibrated_gloo_fit_where_there_is_one():
    """A profiled cluster's intra-host all_reduce fit (here: 4 ms a call on 2 ranks) sets the queue messages' cost
    (one ring hop each: alpha/2 per message on 2 ranks), not the link's datasheet latency."""
    import dataclasses

    from adaptdist.cost_models.hardware import AlphaBeta

    c = FixedCluster.uniform([("h", 2)], "cpu", memory_bandwidth_bytes_per_s=1e10, op_overhead_s=1e-5)
    shard_rows = [[(0, 610), (1, 9742), (2, 21)], []]
    fitted = dataclasses.replace(c, fits={("all_reduce", "intra_host"): AlphaBeta(4e-3, 0.0, 2)})
    plain = async_cost(SHAPE, c, ("sparse", "dense"), shard_rows, 1)
    cal = async_cost(SHAPE, fitted, ("sparse", "dense"), shard_rows, 1)
    assert cal.comm_s[0] == pytest.approx(2 * 2e-3) and cal.comm_s[0] != pytest.approx(plain.comm_s[0])


def test_auto_puts_the_dense_part_on_the_gpus_and_the_tables_on_the_cpu_hosts():
    cluster = load_cluster(str(CPU_GPU))
    choice = choose_mode(SHAPE, cluster, "auto", 1)
    assert choice.mode == "async-hetero", choice.candidates
    assert choice.layout.dense_ranks == (4, 5) and choice.layout.sparse_ranks == (0, 1, 2, 3)
    assert choice.layout.sharding == "row"  # the movies' table alone outweighs the others
    assert choice.cost.step_s < choice.candidates["sync on 6 ranks"].step_s


def test_the_cost_model_chooses_between_tables_by_rows_and_whole_tables():
    """Row-wise shards cost each sparse rank a lookup and an update per table; whole tables one per table held. With
    four equal tables on two sparse ranks the whole tables win. With four tables of near-equal rows but one read 400
    times a row, whole tables balance the rows (the placement rule alone would keep them whole) but not the
    lookups: rows win. The layout that runs is the cheaper candidate."""
    from adaptdist.hetero_layout import shard_tables

    cluster = FixedCluster.uniform([("h", 3)], "cpu", memory_bandwidth_bytes_per_s=1e10, op_overhead_s=2e-5)
    kw = dict(dense_flops_per_row=2e4, dense_bytes_per_row=2e3, dense_params=9000, dense_ops=60, batch_size=256,
              optimizer="sgd")
    even = RecsysShape(table_rows=(1000,) * 4, dim=16, ids_per_row=(1,) * 4, **kw)
    choice = choose_mode(even, cluster, "async-hetero", 1, dense_ranks=(2,))
    rows, whole = (choice.candidates[f"async-hetero, dense ranks 2, {h}"] for h in ("tables by rows", "whole tables"))
    assert whole.step_s < rows.step_s and choice.layout.sharding == "table" and choice.cost == whole
    hot = RecsysShape(table_rows=(1000, 900, 900, 800), dim=64, ids_per_row=(400, 1, 1, 1), **kw)
    assert shard_tables(hot.table_rows, [0, 1])[1] == "table"
    choice = choose_mode(hot, cluster, "async-hetero", 1, dense_ranks=(2,))
    rows, whole = (choice.candidates[f"async-hetero, dense ranks 2, {h}"] for h in ("tables by rows", "whole tables"))
    assert rows.step_s < whole.step_s and choice.layout.sharding == "row" and choice.cost == rows
    # fewer tables than sparse ranks: rows only
    few = choose_mode(SHAPE, FixedCluster.uniform([("h", 5)], "cpu"), "async-hetero", 1, dense_ranks=(4,))
    assert [k for k in few.candidates if k.startswith("async")] == ["async-hetero, dense ranks 4, tables by rows"]


def test_auto_keeps_sync_where_the_dense_work_dominates():
    heavy = RecsysShape(table_rows=(50, 50), dim=8, ids_per_row=(1, 1), dense_flops_per_row=5e7,
                        dense_bytes_per_row=1e4, dense_params=10_000, dense_ops=60, batch_size=256)
    choice = choose_mode(heavy, FixedCluster.uniform([("h", 4)], "cpu"), "auto", 1)
    assert choice.mode == "sync" and choice.layout is None and "faster" in choice.reason
    # sync; 1..3 dense ranks with the tables by rows, and whole where there are as many tables as sparse ranks
    assert len(choice.candidates) == 6, list(choice.candidates)
    forced = choose_mode(heavy, FixedCluster.uniform([("h", 4)], "cpu"), "async-hetero", 1, dense_ranks=(1, 3))
    assert forced.mode == "async-hetero" and forced.layout.roles == ("sparse", "dense", "sparse", "dense")
    one = choose_mode(SHAPE, FixedCluster.uniform([("h", 1)], "cpu"), "auto", 1)
    assert one.mode == "sync" and "one rank" in one.reason
    with pytest.raises(UsageError, match="2 or more ranks"):
        choose_mode(SHAPE, FixedCluster.uniform([("h", 1)], "cpu"), "async-hetero", 1)


# --- the commands -------------------------------------------------------------------------------------------------

@pytest.fixture()
def folder(tmp_path):
    return ml.save(ml.generate(num_users=40, num_movies=60, num_genres=6, num_ratings=300, max_genres=3),
                   tmp_path / "ml")


def test_plan_shows_the_mode_and_each_ranks_role(folder, tmp_path, capsys):
    from adaptdist.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", "builtin:dlrm", "--data", str(folder), "--batch-size", "16", "--nproc", "3",
               "--mode", "async-hetero", "--dense-ranks", "2", "--max-staleness", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "execution mode: async-hetero" in text and "rank 2: dense" in text and "rank 0: sparse: table" in text
    assert "max staleness 4" in text
    saved = json.loads(out.read_text())
    assert saved["roles"] == {"0": "sparse", "1": "sparse", "2": "dense"} and saved["max_staleness"] == 4


@pytest.mark.parametrize("flags,match", [
    (["--plan", "dp"], "does not take --plan dp"),
    (["--dense-ranks", "0,1"], "leaves no sparse rank"),
    (["--precision", "bf16"], "does not take --precision bf16"),
    (["--mode", "sync", "--max-staleness", "3"], "--max-staleness bounds the queues of --mode async-hetero"),
])
def test_train_refuses_what_async_hetero_cannot_run_before_starting_ranks(folder, tmp_path, capsys, flags, match):
    from adaptdist.cli import main

    rc = main(["train", "builtin:dlrm", "--data", str(folder), "--batch-size", "16", "--nproc", "2", "--steps", "1",
               "--mode", "async-hetero", "--out", str(tmp_path / "run"), *flags])
    assert rc == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "run" / "run.json").exists()


def test_async_hetero_needs_a_recommender(tmp_path, capsys):
    from adaptdist.cli import main

    rc = main(["plan", "builtin:gpt", "--batch-size", "2", "--seq-len", "8", "--mode", "async-hetero"])
    assert rc == 2 and "needs a model with .sparse_arch.tables and .dense_arch" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_async_hetero_writes_mode_roles_staleness_and_rmse(folder, tmp_path, capsys):
    """3 gloo ranks, 2 sparse ahead of 1 dense by at most 2 batches: summary.json has the mode, the roles, K and
    the validation RMSE of the weights written, and the losses and weights equal the one-process schedule (which
    tests/test_async_hetero.py pins to a stale-table reference)."""
    import copy

    from safetensors.torch import load_file

    from adaptdist.cli import main
    from adaptdist.hetero_layout import make_layout
    from adaptdist.runtime.async_hetero import simulate

    out = tmp_path / "run"
    rc = main(["train", "builtin:dlrm", "--data", str(folder), "--batch-size", "16", "--nproc", "3", "--steps", "8",
               "--mode", "async-hetero", "--dense-ranks", "2", "--max-staleness", "2", "--optimizer", "sgd",
               "--lr", "0.05", "--out", str(out), "--timeout-s", "60"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["mode"] == "async-hetero" and s["max_staleness"] == 2 and s["steps"] == 8
    assert s["roles"] == {"0": "sparse", "1": "sparse", "2": "dense"}
    assert all(math.isfinite(v) for v in s["losses"]) and s["samples_per_s"] > 0
    torch.manual_seed(0)
    model, _, loss_fn = dlrm.factory(16, 1, data_path=str(folder))
    want = copy.deepcopy(model)
    lay = make_layout(3, (2,), [t.weight.shape[0] for t in model.sparse_arch.tables], 2)
    sim = simulate(want, loss_fn, dlrm.data(16, 1, path=str(folder)), lay, 8, "sgd", 0.05)
    assert s["losses"] == pytest.approx(sim.losses, abs=1e-5)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    assert dlrm.evaluate(model, str(folder))[0]["validation_rmse"] == pytest.approx(s["validation_rmse"], rel=1e-6)
    assert json.loads((out / "run.json").read_text())["state"] == "complete"
    assert "execution mode: async-hetero" in capsys.readouterr().err


def test_auto_stays_sync_where_a_flag_asks_for_the_synchronous_programs(folder, capsys):
    from adaptdist.cli import main

    rc = main(["plan", "builtin:dlrm", "--data", str(folder), "--batch-size", "16", "--nproc", "2", "--plan", "dp"])
    text = capsys.readouterr().out
    assert rc == 0 and "execution mode: sync (auto: --plan dp asks for the synchronous programs)" in text
    assert "plan 'dp'" in text  # and the synchronous plan follows, as before


def test_restarts_and_resumes_keep_the_checkpoints_mode(folder):
    """--max-restarts no longer forces sync (async-hetero checkpoints and restarts); a resumed run keeps the mode of
    its newest checkpoint, and a mode forced against it is refused."""
    import argparse

    from adaptdist.calibrate.local import local_cluster
    from adaptdist.cli.modes import resolve_mode

    torch.manual_seed(0)
    model, example, _ = dlrm.factory(16, 1, data_path=str(folder))

    def choose(mode="auto", **kw):
        args = argparse.Namespace(mode=mode, max_staleness=None, dense_ranks=None, plan="auto", optimizer="sgd",
                                  max_restarts=1)
        return resolve_mode(args, model, example, local_cluster(2), None, **kw)

    assert "--max-restarts" not in choose().reason
    assert choose(mode="async-hetero").mode == "async-hetero"
    resumed = choose(resuming=True, resume_kind="async-hetero")
    assert resumed.mode == "async-hetero" and "--resume" in resumed.reason
    assert choose(resuming=True, resume_kind="sync").mode == "sync"
    assert choose(resuming=True, resume_kind=None).mode == "sync"
    with pytest.raises(UsageError, match="async-hetero one; resume it without --mode sync"):
        choose(mode="sync", resuming=True, resume_kind="async-hetero")
    with pytest.raises(UsageError, match="--mode sync one"):
        choose(mode="async-hetero", resuming=True, resume_kind="sync")


# --- the synchronous candidate is the plan --mode sync runs ----------------------------------------------------------

def _two_cpu_cluster(tmp_path) -> Path:
    """tests/goldens/cluster_4cpu.yaml's first two ranks (figures written down: the plan does not depend on the
    machine)."""
    lines = (ROOT / "tests" / "goldens" / "cluster_4cpu.yaml").read_text().splitlines()
    keep = [x for x in lines if "rank: 2" not in x and "rank: 3" not in x]
    path = tmp_path / "cluster_2cpu.yaml"
    path.write_text("\n".join(keep) + "\n")
    return path


@pytest.fixture()
def big_folder(tmp_path):
    """Tables big enough to be gathered under dp (passes/gather_embedding_rows.py: 64 KiB and more)."""
    return ml.save(ml.generate(num_users=600, num_movies=1200, num_genres=6, num_ratings=3000, max_genres=3),
                   tmp_path / "ml_big")


def test_program_pricing_of_the_dp_programs_is_sync_cost(big_folder, tmp_path):
    """program_sync_cost (the lowered programs' collectives, batch rows and gathered tables) gives sync_cost's step
    for the data-parallel programs sync_cost describes (the users' and movies' tables gathered, the genres' in the
    all_reduce), at 256 and 16 rows."""
    from adaptdist.annotations import ManualPlan
    from adaptdist.cluster_file import load_cluster as load_file
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.cost_models.recsys import program_sync_cost
    from adaptdist.lowering_options import LoweringOptions

    cluster = load_file(_two_cpu_cluster(tmp_path))
    for batch in (256, 16):
        torch.manual_seed(0)
        model, example, loss_fn = dlrm.factory(batch, 1, data_path=str(big_folder))
        assert gathered_tables(recsys_shape(model, example, "adamw"), 2) == (True, True, False)
        shape = recsys_shape(model, example, "adamw")
        progs = compile_model(model, example, loss_fn, 2, ManualPlan.parse("dp", dlrm), LoweringOptions(),
                              cluster=cluster, optimizer="adamw")
        want, got = sync_cost(shape, cluster), program_sync_cost(shape, cluster, progs)
        assert got.comm_s == pytest.approx(want.comm_s, rel=1e-9)
        assert got.step_s == pytest.approx(want.step_s, rel=1e-3), (batch, got, want)


@pytest.mark.parametrize("flags", [[], ["--mode", "sync"], ["--batch-size", "256"]])
def test_the_mode_choice_prices_the_plan_that_plan_and_train_lower(big_folder, tmp_path, flags):
    """resolve_mode plans and lowers the synchronous programs first and prices them; resolve_plan (the door of
    `plan` and `train`) then hands the lowering that very plan, whose programs price the same as the candidate the
    mode choice weighed (not a data-parallel stand-in: at 16 rows the planner replicates the batch)."""
    from adaptdist.cli.common import lowering_options, resolve_plan
    from adaptdist.cli.main import build_parser
    from adaptdist.cli.modes import resolve_mode
    from adaptdist.cluster_file import load_cluster as load_file
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.planner.modes import mode_lines
    from adaptdist.cost_models.recsys import program_sync_cost
    from adaptdist.model_spec import ModelSpec

    cluster_file = _two_cpu_cluster(tmp_path)
    args = build_parser().parse_args(["plan", "builtin:dlrm", "--data", str(big_folder), "--cluster",
                                      str(cluster_file), "--batch-size", "16", *flags])
    cluster = load_file(cluster_file)
    spec = ModelSpec.parse(args.model)
    torch.manual_seed(0)
    model, example, loss_fn = spec.build(args.batch_size, args.seq_len, data_path=args.data)
    choice = resolve_mode(args, model, example, cluster, None, loss_fn=loss_fn)
    priced, name = choice.candidates["sync on 2 ranks"], choice.sync_plan
    plan, captured = resolve_plan(args, spec, model, example, loss_fn, cluster, _Quiet(), "adamw")
    assert plan is args._sync_plan.plan  # not planned a second time
    programs = compile_model(model, example, loss_fn, 2, plan, lowering_options(args, cluster), captured=captured,
                             cluster=cluster, optimizer="adamw")
    for r, p in programs.items():  # the programs the command lowers are the ones the mode choice priced
        assert p.code == args._sync_plan.programs[r].code
    assert program_sync_cost(recsys_shape(model, example, "adamw"), cluster, programs).step_s == priced.step_s
    mesh = ",".join(f"{a}={n}" for a, n in programs[0].mesh.items())
    assert name.startswith(f"plan 'auto': mesh {mesh}")
    assert any(line.startswith(f"  predicted sync on 2 ranks (plan 'auto': mesh {mesh}") for line in mode_lines(choice))
    if args.batch_size == 16:  # the planner's choice: every rank the whole batch, no collective (not dp)
        assert "batch replicated" in name and priced.comm_s[0] == 0
        assert priced.step_s < sync_cost(recsys_shape(model, example, "adamw"), cluster).step_s


class _Quiet:
    def print(self, *a, **k):
        pass


def test_the_dp_plans_table_gradients_travel_in_one_all_gather(big_folder, tmp_path):
    """The automatic plan on dp=2 (builtin:dlrm, 256 rows) issues one all_gather a step: every table gradient built
    from gathered rows takes them from it (the users' and movies' rows and ids merged:
    passes/bucket_gathered_rows.py), and nothing else is gathered."""
    from adaptdist.cluster_file import load_cluster as load_file
    from adaptdist.compiler.capture import capture
    from adaptdist.compiler.lowering import compile_model
    from adaptdist.compiler.planner.summary import run_planner
    from adaptdist.cost_models.communication import functional_collective_kind
    from adaptdist.lowering_options import LoweringOptions

    cluster = load_file(_two_cpu_cluster(tmp_path))
    torch.manual_seed(0)
    model, example, loss_fn = dlrm.factory(256, 1, data_path=str(big_folder))
    cg = capture(model, example, loss_fn)
    plan = run_planner(cg, cluster, "dp=2", "adamw", None, pipeline=False).plan
    progs = compile_model(model, example, loss_fn, 2, plan, LoweringOptions(), captured=cg, cluster=cluster,
                          optimizer="adamw")
    graph = progs[0].graph_module.graph
    feeding = set()
    for n in graph.find_nodes(op="call_function", target=torch.ops.aten.embedding_dense_backward.default):
        seen, todo = set(), [n.args[1]]  # the ids (gathered with the rows: one buffer)
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.op == "call_function" and functional_collective_kind(m.target) == "all_gather":
                feeding.add(m)
            else:
                todo.extend(m.all_input_nodes)
    assert len(feeding) == 1, progs[0].collectives()
    (g,) = feeding
    gathered = g.args[0].meta["val"].numel()
    tables = [t for t in model.sparse_arch.tables if t.weight.numel() * 4 >= 65536]
    assert gathered == len(tables) * 128 * (32 + 1), progs[0].collectives()  # rows [128, 32] and ids of each
    # and no other all_gather: the genres bag (sum mode, per-sample weights) keeps the batch split, its weights are
    # not gathered in forward and sliced back (its rule once asked for them replicated), nor its offsets in backward
    assert [c for c in progs[0].collectives() if "all_gather" in c] == [
        f"_c10d_functional.all_gather_into_tensor.default(adaptdist:dp, {gathered})"]
    # and those programs train as eager does (loss, gradients, SGD-updated parameters), the genres' split bag included
    from passutil import assert_sgd_equal, simulated_sgd
    from reference import eager_sgd

    _, hist, params, _ = simulated_sgd(model, example, loss_fn, 2, plan, 0.05, 2)
    want_hist, want_params = eager_sgd(model, [example], loss_fn, 0.05, 2)
    assert_sgd_equal(hist, params, want_hist, want_params)
