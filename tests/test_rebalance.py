"""Adaptive re-balance (``adaptdist/runtime/rebalance.py``): rows from the speeds measured in the run, the state
moved into programs lowered with the new rows, and the steps before and after equal to single-process eager SGD
(loss, every gradient, the updated parameters), ranks simulated in one process."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptdist.cluster_file import cluster_from_dict
from adaptdist.compiler.lowering import compile_model
from adaptdist.cost_models.estimate import estimate_programs
from adaptdist.errors import AdaptdistError
from adaptdist.compiler.rebalance_rows import decide
from adaptdist.runtime.rebalance import step_compute_s, transfer_state
from adaptdist.runtime.simulate import simulate_ranks
from adaptdist.runtime.trace import TraceRecorder
from adaptdist.runtime.worker import StepRunner
from models import mlp
from reference import eager_sgd

TOL = 1e-5


def _cluster(flops=(1e10, 1e10, 1e10)):
    devs = [{"rank": r, "kind": "cpu", "peak_flops": {"float32": f}, "memory_bytes": 2**32,
             "memory_bandwidth_bytes_per_s": f} for r, f in enumerate(flops)]
    return cluster_from_dict({"schema_version": 2, "hosts": [{"name": "localhost", "devices": devs}],
                              "links": [{"tier": "intra_host", "bandwidth_bytes_per_s": 1.5e9, "latency_s": 2e-4}]})


def _simulated_step(runners, batch):
    """One SGD step of every rank's StepRunner, collectives simulated; returns rank 0's loss and gradients."""
    ins = [list(r.inputs) + list(r.program.local_batch(batch)) for r in runners]
    outs = simulate_ranks([r.program.module for r in runners], ins)
    for r, o in zip(runners, outs):
        for p, i in zip(r.params, r.grad_slots):
            p.grad = o[i]
        r.opt.step()
        for p in r.params:
            p.grad = None
    roles = runners[0].program.output_roles
    return float(outs[0][roles.index("loss")]), {role[5:]: outs[0][i] for i, role in enumerate(roles)
                                                 if role.startswith("grad:")}


def test_rows_changed_mid_run_equal_eager_sgd():
    model, batch, loss_fn = mlp(12, loss="mse")
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 12, generator=g), torch.randn(12, 5, generator=g)) for _ in range(4)]
    cluster = _cluster()
    lr = 0.1
    first = compile_model(copy.deepcopy(model), batch, loss_fn, 3, None, cluster=cluster, optimizer="sgd")
    assert [p.batch_slice[1] for p in first.values()] == [4, 4, 4]
    runners = [StepRunner(first[r], "sgd", lr) for r in range(3)]
    history, final = eager_sgd(copy.deepcopy(model), batches, loss_fn, lr, 4)
    for step in range(4):
        if step == 2:  # the re-balance: the same plan lowered with other rows, the live state moved over
            new = compile_model(copy.deepcopy(model), batch, loss_fn, 3, first[0].plan, cluster=cluster,
                                optimizer="sgd", batch_split=(2, 3, 7))
            assert [p.batch_slice for p in new.values()] == [(0, 2), (2, 3), (5, 7)]
            moved = [StepRunner(new[r], "sgd", lr) for r in range(3)]
            for old, fresh in zip(runners, moved):
                transfer_state(old, fresh)
            runners = moved
        loss, grads = _simulated_step(runners, batches[step])
        ref_loss, ref_grads = history[step]
        assert loss == pytest.approx(ref_loss, abs=TOL), step
        for f, gr in grads.items():
            torch.testing.assert_close(gr, ref_grads[f], atol=TOL, rtol=TOL, msg=f"step {step}: {f}")
    for r in runners:
        for f in r.program.param_fqns:
            torch.testing.assert_close(r.state[f], final[f], atol=TOL, rtol=TOL, msg=f)


def test_transfer_state_moves_adamw_state_and_refuses_other_state():
    model, batch, loss_fn = mlp(12, loss="mse")
    a = compile_model(copy.deepcopy(model), batch, loss_fn, 3, None, cluster=_cluster(), optimizer="adamw")
    b = compile_model(copy.deepcopy(model), batch, loss_fn, 3, a[0].plan, cluster=_cluster(), optimizer="adamw",
                      batch_split=(6, 3, 3))
    old, new = StepRunner(a[0], "adamw", 0.01), StepRunner(b[0], "adamw", 0.01)
    for p in old.params:
        p.grad = torch.ones_like(p)
    old.opt.step()
    transfer_state(old, new)
    for p_old, p_new in zip(old.params, new.params):
        torch.testing.assert_close(p_new, p_old)
        for k, v in old.opt.state[p_old].items():
            torch.testing.assert_close(new.opt.state[p_new][k], v)
    other = StepRunner(compile_model(torch.nn.Linear(12, 5), batch, loss_fn, 3, None)[0], "adamw", 0.01)
    with pytest.raises(AdaptdistError, match="other state"):
        transfer_state(old, other)


def test_decide_follows_measured_speeds():
    model, batch, loss_fn = mlp(64, loss="mse")
    cluster = _cluster()
    programs = compile_model(model, batch, loss_fn, 3, None, cluster=cluster, optimizer="sgd")
    assert [p.batch_slice[1] for p in programs.values()] == [22, 22, 20]
    pred = [estimate_programs(programs, cluster, "sgd").ranks[r].compute_s for r in range(3)]
    # ranks 0 and 1 measured twice as slow per row as rank 2: about 16/16/32
    d = decide(programs, cluster, [2 * pred[0], 2 * pred[1], pred[2] * 20 / 22], "sgd", step=5)
    assert d.applied and sum(d.rows_after) == 64 and d.rows_before == (22, 22, 20), d
    assert d.rows_after[2] >= 30 and max(d.rows_after[:2]) <= 17, d
    assert d.predicted_gain > 1.25 and "re-balance after step 5" in d.line() and "rows -> " in d.line()
    assert d.to_doc()["rows_after"] == d.rows_after
    # the same medians from a noisy window (+-30% on rank 2): not enough evidence to move rows
    noisy = decide(programs, cluster, [2 * pred[0], 2 * pred[1], pred[2] * 20 / 22], "sgd", step=5,
                   noise=[0.01, 0.01, 0.3])
    assert not noisy.applied and noisy.threshold == pytest.approx(1.6) and "noise" in noisy.reason, noisy
    # measured as predicted: nothing to gain
    same = decide(programs, cluster, pred, "sgd", step=5)
    assert not same.applied and same.rows_after == same.rows_before and "kept" in same.line()
    with pytest.raises(AdaptdistError, match="positive compute time"):
        decide(programs, cluster, [0.1, 0.0, 0.1], "sgd", step=5)


def test_median_and_noise():
    from adaptdist.runtime.rebalance import median_and_noise

    assert median_and_noise([0.1] * 6) == (0.1, 0.0)
    med, se = median_and_noise([1.0, 2.0, 3.0, 4.0, 50.0])  # median absolute deviation 1 (an outlier does not count)
    assert med == 3.0 and se == pytest.approx(1.2533 * 1.4826 / 5 ** 0.5 / 3)
    assert median_and_noise([2.0]) == (2.0, 0.0)


def test_step_compute_s_subtracts_waits():
    t = [0.0]
    rec = TraceRecorder(0, clock=lambda: t[0])
    for step, (length, wait) in enumerate([(1.0, 0.25), (2.0, 0.0)]):
        with rec.step(step):
            rec.add("wait", t[0], t[0] + wait)
            t[0] += length
    assert step_compute_s(rec, [0, 1]) == [0.75, 2.0]
    assert step_compute_s(rec, [1]) == [2.0]


MODEL_FILE = '''
import torch, torch.nn as nn, torch.nn.functional as F

def f(batch_size, seq_len):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
    return model, (torch.randn(batch_size, 64), torch.randn(batch_size, 8)), F.mse_loss

def data(batch_size, seq_len, seed=0):
    g = torch.Generator().manual_seed(123)
    while True:
        yield torch.randn(batch_size, 64, generator=g), torch.randn(batch_size, 8, generator=g)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_rebalances_rows_and_stays_equal_to_eager(tmp_path):
    """`adaptdist train` on a cluster file that calls rank 2 eight times as fast as ranks 0 and 1, run on ranks that
    are alike: the profiled rows over-load rank 2 far beyond the measurements' noise, the re-balance after 8 steps
    (7 steps measured) evens them out, and every step's loss and the final weights equal single-process eager SGD."""
    import importlib.util
    import json

    import yaml
    from safetensors.torch import load_file

    from adaptdist.cli import main

    f = tmp_path / "m.py"
    f.write_text(MODEL_FILE)
    c = tmp_path / "c.yaml"
    devs = [{"rank": r, "kind": "cpu", "peak_flops": {"float32": x}, "memory_bytes": 2**32,
             "memory_bandwidth_bytes_per_s": x / 2} for r, x in enumerate((1e10, 1e10, 8e10))]
    c.write_text(yaml.safe_dump({"schema_version": 2, "hosts": [{"name": "localhost", "devices": devs}],
                                 "links": [{"tier": "intra_host", "bandwidth_bytes_per_s": 1.5e9, "latency_s": 2e-4}]}))
    steps, lr, out = 9, 0.05, tmp_path / "out"
    assert main(["train", f"{f}:f", "--cluster", str(c), "--plan", "dp", "--batch-size", "768", "--steps", str(steps),
                 "--optimizer", "sgd", "--lr", str(lr), "--rebalance-after", "8", "--threads-per-rank", "1",
                 "--sample-bytes", "0", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    [rb] = summary["rebalances"]
    assert rb["step"] == 8 and sum(rb["rows_before"]) == 768 and rb["rows_before"][2] > 3 * rb["rows_before"][0], rb
    assert rb["applied"] and rb["rows_after"][2] < rb["rows_before"][2], rb  # the alike ranks get alike rows
    spec = importlib.util.spec_from_file_location("m", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, _, loss_fn = mod.f(768, 0)
    batches = [b for b, _ in zip(mod.data(768, 0), range(steps))]
    history, final = eager_sgd(model, batches, loss_fn, lr, steps)
    assert summary["losses"] == pytest.approx([h[0] for h in history], rel=1e-5, abs=1e-6)
    weights = load_file(str(out / "model.safetensors"))
    for k, v in final.items():
        torch.testing.assert_close(weights[k], v, atol=TOL, rtol=TOL, msg=k)


def test_rebalance_after_flag():
    from types import SimpleNamespace

    from adaptdist.cli.train import REBALANCE_AFTER_AUTO, _rebalance_after
    from adaptdist.errors import UsageError

    model, batch, loss_fn = mlp(12, loss="mse")
    uneven = compile_model(model, batch, loss_fn, 3, None, cluster=_cluster((1e10, 1e10, 2e10)), optimizer="sgd")
    even = compile_model(model, batch, loss_fn, 3, None, cluster=_cluster(), optimizer="sgd")
    c = _cluster()

    def after(text, programs):
        return _rebalance_after(SimpleNamespace(rebalance_after=text), programs, c, False, None)

    assert after("auto", uneven) == REBALANCE_AFTER_AUTO  # the planner split by profiled speeds: check them
    assert after("auto", even) is None and after("off", uneven) is None
    assert after("4", even) == 4
    for bad in ("1", "x"):
        with pytest.raises(UsageError, match="--rebalance-after"):
            after(bad, even)
