"""The torch.compile backend: ``torch.compile(model, backend="adaptdist")`` in an ordinary training loop.

Real gloo processes (all cases of one world size in one process group): each rank passes its own rows
of the global batch (DDP's contract); after each of 3 SGD steps, its loss equals eager's loss on those
rows, every parameter's gradient equals the gradient of the ranks' mean loss in single-process eager
PyTorch, and the parameters after the steps equal eager's, all to 1e-5. In-process (world of one): graph
breaks, fullgraph=True, the entry point.
"""

import importlib.util
import re
import warnings

import pytest
import torch
import torch.nn as nn

import adaptdist
from adaptdist.compiler.dynamo_backend import GraphBreakWarning
from adaptdist.runtime.launch import launch_local
from adaptdist import errors as adaptdist_errors
from backend_workers import FACTORIES, sequential_mlp, suite_worker

STEPS, LR, TOL = 3, 0.5, 1e-5

CASES = {
    2: [dict(model="gpt", plan="dp", batch=4), dict(model="gpt", plan="tp", batch=4),
        dict(model="gpt", plan="fsdp", batch=4, clip=0.05), dict(model="mlp", plan="auto", batch=6),
        # each rank builds its model from its own seed: every rank must train rank 0's (DDP's broadcast)
        dict(model="mlp", plan="dp", batch=6, rank_seeded=True), dict(model="gpt", plan="fsdp", batch=4, rank_seeded=True)],
    4: [dict(model="gpt", plan="dp", batch=4), dict(model="gpt", plan="tp", batch=4),
        dict(model="gpt", plan="dp,tp", mesh="dp=2,tp=2", batch=4, clip=0.05)],  # one local shape: see below
}


HF_GPT2_CASES = [dict(model="hf_gpt2", plan="dp", batch=4), dict(model="hf_gpt2", plan="auto", batch=4)]
HF_LLAMA_TP_CASES = [dict(model="hf_llama", plan="tp", batch=4)]  # plan="tp": the model's own (HF) plan
HF_BERT_CASES = [dict(model="hf_bert", plan="dp", batch=4), dict(model="hf_bert", plan="fsdp", batch=4)]
SCALAR_CASES = [dict(model="scalar_loss", plan="auto", batch=6), dict(model="scalar_loss", plan="dp", batch=6)]
SHM_CASES = [dict(model="mlp", plan="dp", batch=6, comm="shm"), dict(model="mlp", plan="fsdp", batch=6, comm="shm")]
SCALAR_LR = 0.05
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SUITE_TIMEOUT_S = 1800  # the first test to use a launch fixture waits for all of its parts (14 on 2 ranks)


# The slow tests of one world size share one launch (starting ranks costs seconds each): module-scoped
# fixtures run every check's worker in one process group (backend_workers.suite_worker, Dynamo reset between
# them) and each test reads its part. A part that raised fails only its own test, with the rank's traceback.
def _suite_parts(world: int) -> list[tuple[str, str, tuple]]:
    if world == 4:
        return [("sgd", "backend_sgd_worker", (CASES[4], STEPS, LR)),
                ("interleaved", "interleaved_meshes_worker", (2, LR)),
                ("memory", "sharded_memory_worker", ("fsdp",))]
    parts = [("sgd", "backend_sgd_worker", (CASES[2], STEPS, LR)),
             ("scalar", "backend_sgd_worker", (SCALAR_CASES, STEPS, SCALAR_LR)),
             ("memory", "sharded_memory_worker", ("fsdp",)),
             ("usage", "sharded_usage_worker", ()),
             ("sequential", "sequential_worker", (STEPS, LR)),
             ("mismatch", "mismatch_worker", (60.0, False)),
             ("mismatch_break", "mismatch_worker", (60.0, True)),
             ("divergence", "divergence_worker", ()),
             ("wrong_shape", "wrong_shape_worker", (60.0,))]
    if adaptdist.kernels.available():
        parts.append(("shm", "backend_sgd_worker", (SHM_CASES, STEPS, LR)))
    if HAS_TRANSFORMERS:
        parts += [("hf_gpt2", "backend_sgd_worker", (HF_GPT2_CASES, STEPS, LR)),
                  ("hf_bert", "backend_sgd_worker", (HF_BERT_CASES, STEPS, LR)),
                  ("hf_llama_tp", "backend_sgd_worker", (HF_LLAMA_TP_CASES, STEPS, LR)),
                  ("retrace_llama", "hf_retrace_worker", ("llama", "fsdp", LR)),
                  ("retrace_gpt2", "hf_retrace_worker", ("gpt2", "dp", LR))]
    return parts + [("teardown", "teardown_worker", ())]  # last: it destroys the process group


@pytest.fixture(scope="module")
def ranks2():
    return launch_local(suite_worker, (_suite_parts(2),), 2)


@pytest.fixture(scope="module")
def ranks4():
    return launch_local(suite_worker, (_suite_parts(4),), 4)


def _part(suite: dict, key: str) -> dict:
    """{rank: what part ``key``'s worker returned on that rank}; fails the test with a rank's traceback if it
    raised there."""
    for r, parts in sorted(suite.items()):
        status, value = parts[key]
        if status != "ok":
            pytest.fail(f"rank {r}, part {key!r} raised:\n{value}")
    return {r: parts[key][1] for r, parts in suite.items()}


# The cases of a world size share one process, and Dynamo makes the batch size symbolic when the same
# forward code meets a second one (automatic dynamic shapes), which the backend refuses; so every case of
# a world size has the same rows per rank (test_symbolic_shapes_are_refused_clearly covers the refusal).


def _eager(case: dict, world: int, lr: float = LR, steps: int = STEPS):
    """Per step: each rank's loss on its rows and the gradients of their mean; final parameters."""
    model, (x, y), loss_fn = FACTORIES[case["model"]](case["batch"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        losses = [loss_fn(model(xr), yr) for xr, yr in zip(x.chunk(world), y.chunk(world))]
        (sum(losses) / world).backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        history.append(([v.item() for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_cases_equal_eager(cases: list[dict], results: dict, world: int, lr: float = LR) -> dict:
    """Each rank's per-step losses and gradients and its final parameters equal single-process eager's (see
    :func:`_eager`), for every case; returns case index -> eager's final parameters."""
    finals = {}
    for k, case in enumerate(cases):
        history, params = _eager(case, world, lr)
        for r in range(world):
            got = results[r][k]
            for s, (losses, grads) in enumerate(history):
                assert got["losses"][s] == pytest.approx(losses[r], abs=TOL), (case, r, s)
                for n, g in grads.items():
                    torch.testing.assert_close(got["grads"][s][n], g, atol=TOL, rtol=0, msg=f"{case} rank {r} step {s} {n}")
            for n, p in params.items():
                torch.testing.assert_close(got["params"][n], p, atol=TOL, rtol=0, msg=f"{case} rank {r} {n}")
        finals[k] = params
    return finals


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
@pytest.mark.parametrize("world", [2, 4])
def test_backend_sgd_equals_eager(world, request):
    results = _part(request.getfixturevalue(f"ranks{world}"), "sgd")
    finals = _assert_cases_equal_eager(CASES[world], results, world)
    for k, case in enumerate(CASES[world]):
        params = finals[k]
        for r in range(world):
            got = results[r][k]
            trained, (x, _), _ = FACTORIES[case["model"]](case["batch"])
            trained.load_state_dict(params, strict=False)
            with torch.no_grad():
                want = trained(x.chunk(world)[r])
            torch.testing.assert_close(got["eval_out"], want, atol=TOL, rtol=0, msg=f"{case} rank {r} eval")
        mesh = results[0][k]["meshes"][0]
        calls = results[0][k]["collectives"][0]
        if case["plan"] in ("tp", "dp,tp"):
            assert mesh.get("tp") == (2 if case["plan"] == "dp,tp" else world), mesh
            assert any("adaptdist:tp" in c for c in calls), calls  # the model really runs tensor-parallel
        if case["plan"] == "dp":
            assert mesh == {"dp": world} and all("adaptdist:dp" in c for c in calls), calls
        full_numel = sum(p.numel() for p in params.values())
        if case["plan"] in ("tp", "fsdp", "dp,tp"):  # each rank holds only its shards from the first call on
            assert results[0][k]["local_numel"] < full_numel, (case, results[0][k]["local_numel"], full_numel)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_hugging_face_gpt2_through_the_backend(ranks2):
    """A Hugging Face GPT-2 (its own attention, masks, a ModelOutput) on 2 ranks, dp and the automatic plan."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    _assert_cases_equal_eager(HF_GPT2_CASES, _part(ranks2, "hf_gpt2"), 2)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_hugging_face_llama_with_its_own_tp_plan_through_the_backend(ranks2):
    """``adaptdist.backend(plan="tp")`` on a Hugging Face LLaMA (GQA) whose file defines no TP_PLAN: the model's
    own plan (q/k/v, gate/up column-parallel, o/down row-parallel) shards the weights; 2 ranks equal eager."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    results = _part(ranks2, "hf_llama_tp")
    _assert_cases_equal_eager(HF_LLAMA_TP_CASES, results, 2)
    model = FACTORIES["hf_llama"](4)[0]
    full_numel = sum(p.numel() for p in model.parameters())
    assert results[0][0]["local_numel"] < full_numel, (results[0][0]["local_numel"], full_numel)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_hugging_face_padding_masks_under_dp(ranks2):
    """BERT's padding mask (``mask[batch_idx, kv_idx]``: aten.index with the batch sharded) once had no rule
    under dp; propagation now takes DTensor's strategy, as the planner does. 2 ranks equal eager."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    _assert_cases_equal_eager(HF_BERT_CASES, _part(ranks2, "hf_bert"), 2)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_a_model_returning_its_own_loss_with_python_scalars(ranks2):
    """``return torch.sqrt((y * y).sum() + 1e-3) * 0.1 + 0.5``: the scalars become ``_to_copy(0.1)`` nodes without
    tensor inputs (once an InternalError in propagate_placements); under auto and dp, 2 ranks equal eager."""
    _assert_cases_equal_eager(SCALAR_CASES, _part(ranks2, "scalar"), 2, lr=SCALAR_LR)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_two_models_on_different_meshes_interleaved(ranks4):
    """Each compiled graph uses its own process groups even when another graph's mesh names the same axis, under
    the default comm (auto: the shared-memory kernels where built): the GPT's dp groups (0,2), (1,3) and the MLP's
    dp group (0,1,2,3) are distinct shm groups (named by their ranks), so each model's losses, gradients and
    SGD-updated parameters equal eager's."""
    results = _part(ranks4, "interleaved")
    for k, case in enumerate([dict(model="gpt", batch=4), dict(model="mlp", batch=4)]):
        history, params = _eager(case, 4, steps=2)
        for r in range(4):
            for s, (losses, grads) in enumerate(history):
                assert results[r][k]["losses"][s] == pytest.approx(losses[r], abs=TOL), (case, r, s)
                for n, g in grads.items():
                    torch.testing.assert_close(results[r][k]["grads"][s][n], g, atol=TOL, rtol=0)
            for n, p in params.items():
                torch.testing.assert_close(results[r][k]["params"][n], p, atol=TOL, rtol=0, msg=f"{case} {r} {n}")
            calls = [c for graph in results[r][k]["collectives"] for c in graph]
            if adaptdist.kernels.available():  # auto puts every axis of one host on the kernels
                assert calls and all(c.startswith("adaptdist.shm_") for c in calls), calls
    if adaptdist.kernels.available():
        gpt = {c.split("(", 1)[1].rsplit(", ", 1)[0] for g in results[0][0]["collectives"] for c in g}
        mlp = {c.split("(", 1)[1].rsplit(", ", 1)[0] for g in results[0][1]["collectives"] for c in g}
        assert gpt == {"adaptdist:dp[0,2]", "adaptdist:tp[0,1]"} and mlp == {"adaptdist:dp[0,1,2,3]"}, (gpt, mlp)


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_sharded_plan_memory_falls_with_world_size(ranks2, ranks4):
    """FSDP-like plan, AdamW built before torch.compile: parameters and optimizer state hold 1/W of the
    model on each rank, and the peak-memory metric per rank falls from 2 to 4 ranks."""
    by_world = {2: _part(ranks2, "memory"), 4: _part(ranks4, "memory")}
    model, _, _ = FACTORIES["gpt"](8)
    full = sum(p.numel() for p in model.parameters())
    for w, res in by_world.items():
        assert sum(res[r]["param_numel"] for r in range(w)) == full  # the shards tile the model exactly
        for r in range(w):
            assert res[r]["param_numel"] <= full // w + 64, (w, r, res[r]["param_numel"], full)
            assert res[r]["state_numel"] == 2 * res[r]["param_numel"]  # AdamW: exp_avg, exp_avg_sq on the shard
            assert res[r]["full"] == {k: v.shape for k, v in model.state_dict().items()}
    peak = {w: max(res[r]["peak_bytes"] for r in range(w)) for w, res in by_world.items()}
    assert peak[4] < peak[2], peak


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_training_loop_habits_with_sharded_parameters(ranks2):
    """Accumulating gradients over micro-batches of two shapes, zero_grad(set_to_none=False) then eval,
    state_dict/load_state_dict, and a direct call of the original module, on FSDP-sharded parameters."""
    results = _part(ranks2, "usage")
    model, (x, y), loss_fn = FACTORIES["mlp"](12)
    for rows in ((0, 8), (8, 12)):
        xs, ys = x[rows[0]:rows[1]], y[rows[0]:rows[1]]
        (sum(loss_fn(model(a), b) for a, b in zip(xs.chunk(2), ys.chunk(2))) / 2).backward()
    reference, _, _ = FACTORIES["mlp"](12)
    from models import mlp

    loaded, _, _ = mlp(12, seed=5)
    with torch.no_grad():
        for r in range(2):
            got = results[r]
            for n, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][n], p.grad, atol=TOL, rtol=0, msg=n)
            torch.testing.assert_close(got["eval"], model(x.chunk(2)[r]), atol=TOL, rtol=0)
            assert got["state_dict_warned"]
            assert got["state_dict_shapes"]["fc1.weight"][0] < model.fc1.weight.shape[0]  # a shard
            torch.testing.assert_close(got["after_load"], loaded(x.chunk(2)[r]), atol=TOL, rtol=0)
            for n, v in loaded.state_dict().items():
                torch.testing.assert_close(got["loaded_full"][n], v, atol=0, rtol=0)
            assert "AdaptdistError" in got["direct_call"] and "torch.compile'd model" in got["direct_call"], got


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_top_level_sequential_under_a_sharded_plan(ranks2):
    """nn.Sequential (compiled by Dynamo through another frame than a module's forward) gets the placeholder
    hooks: SGD steps, a no_grad re-trace, a re-trace at a new batch size, the state_dict warning and
    load_state_dict of full tensors all work on its sharded parameters, with eager's numbers."""
    from models import mlp

    results = _part(ranks2, "sequential")
    model = sequential_mlp()
    _, (x, y), loss_fn = mlp(12, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for _ in range(STEPS):
        losses = [loss_fn(model(a), b) for a, b in zip(x[:8].chunk(2), y[:8].chunk(2))]
        (sum(losses) / 2).backward()
        history.append(([v.item() for v in losses], {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    wide = [loss_fn(model(a), b) for a, b in zip(x.chunk(2), y.chunk(2))]
    (sum(wide) / 2).backward()
    loaded = sequential_mlp(seed=5)
    full_numel = sum(p.numel() for p in model.parameters())
    for r in range(2):
        got = results[r]
        for s, (losses, grads) in enumerate(history):
            assert got["losses"][s] == pytest.approx(losses[r], abs=TOL), (r, s)
            for n, g in grads.items():
                torch.testing.assert_close(got["grads"][s][n], g, atol=TOL, rtol=0, msg=f"rank {r} step {s} {n}")
        assert got["local_numel"] < full_numel  # sharded
        with torch.no_grad():
            torch.testing.assert_close(got["eval"], model(x[:8].chunk(2)[r]), atol=TOL, rtol=0)
            torch.testing.assert_close(got["after_load"], loaded(x[:8].chunk(2)[r]), atol=TOL, rtol=0)
        assert got["wide_loss"] == pytest.approx(wide[r].item(), abs=TOL)
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["wide_grads"][n], p.grad, atol=TOL, rtol=0, msg=n)
            torch.testing.assert_close(got["params"][n], p.detach(), atol=TOL, rtol=0, msg=n)
        assert got["state_dict_warned"]
        assert not any("not a module's forward" in line for line in got["log"]), got["log"]
        assert "AdaptdistError" in got["direct_call"] and "torch.compile'd model" in got["direct_call"], got
        assert got["graph_breaks"] == [], got["graph_breaks"]  # the hooks run before the compiled frame
    # rank 0 says what it compiled, once per graph (training, the no_grad eval, the new batch size); rank 1 not
    compiled = [line for line in results[0]["log"] if "compiled graph" in line]
    assert len(compiled) == 3, results[0]["log"]
    assert all("plan 'fsdp" in line and "mesh dp=2" in line and "predicted step" in line and " MiB" in line
               and "compiled in" in line for line in compiled), compiled
    assert not any("compiled graph" in line for line in results[1]["log"]), results[1]["log"]


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_destroy_process_group_stops_the_gloo_threads(ranks2):
    """After destroy_process_group() no gloo worker thread is left: nothing the backend (or torch's
    torch.distributed.nn.functional, imported by the first torch.compile) holds keeps a group alive into
    interpreter finalization, where such a thread aborted the process ("terminate called without an active
    exception"). (Here the rank has run every other check of the 2-rank launch before, each with its own
    backend and groups: destroy_process_group() must stop the threads of all of them.)"""
    results = _part(ranks2, "teardown")
    for r in range(2):
        assert not any("gloo" in name for name in results[r]), results[r]


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
@pytest.mark.parametrize("graph_break", [False, True])
def test_ranks_with_different_graphs_are_refused(graph_break, ranks2):
    """Uneven per-rank batches (2 + 3 rows): the refusal names the input and both shapes and says what to do;
    after a graph break it must not blame a branch on data (fix-lower)."""
    results = _part(ranks2, "mismatch_break" if graph_break else "mismatch")
    for r in (0, 1):
        assert "PlanMismatchError" in results[r] and "compiled different graphs" in results[r], results[r]
        assert "inputs differ: L['x'] is float32[2, 12] on rank 0 but float32[3, 12] on rank 1" in results[r], results[r]
        assert "drop_last=True" in results[r] and "if t.sum() > 0" not in results[r], results[r]


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_a_rank_whose_trace_fails_on_its_input_shape_stops_every_rank_at_once(ranks2):
    """Issue 14: rank 1 passes an input the model cannot take (11 features for an MLP of 12; a 31-wide
    inputs_embeds for Hugging Face GPT-2 of width 32), so Dynamo's trace fails on rank 1 only, at the first step
    (rank 0 compiles) or the second (rank 0 runs the graph and meets rank 1 at its backward). Every rank stops at
    once with a RankInputMismatchError naming the input and both shapes (was: Dynamo's fake-tensor error on rank 1,
    a CollectiveTimeoutError on rank 0 after the timeout), and the ranks stay in step (each case runs after the
    last one's error in the same process group)."""
    results = _part(ranks2, "wrong_shape")
    expected = {"mlp_step0": ("L['x']", "float32[4, 12]", "float32[4, 11]", 0),
                "mlp_step1": ("L['x']", "float32[4, 12]", "float32[4, 11]", 1)}
    if HAS_TRANSFORMERS:
        expected["hf_gpt2"] = ("L['kwargs']['inputs_embeds']", "float32[4, 6, 32]", "float32[4, 6, 31]", 0)
    for r in (0, 1):
        assert set(results[r]) == set(expected), results[r]
        for case, (name, shape0, shape1, done) in expected.items():
            error, steps, seconds = results[r][case]
            # the typed error itself, not Dynamo's InternalTorchDynamoError / BackendCompilerFailed around it
            assert steps == done and error.startswith("RankInputMismatchError: "), (r, case, error)
            assert f"{name} is {shape0} on rank 0 but {shape1} on rank 1" in error, (r, case, error)
            assert "rank 1 could not compile the model" in error and f"(this is rank {r})" in error, (r, case, error)
            assert seconds < 30, (r, case, seconds)  # the collective timeout is 180 s
        assert "a and b must have same reduction dim" in results[r]["mlp_step0"][0]  # the model's own error
        assert "rank 0: about to run the backward of graph" in results[r]["mlp_step1"][0]


def test_input_shape_mismatch_hint_names_the_input_and_the_shapes():
    from adaptdist.runtime.rank_input_shapes import input_shape_mismatch_hint

    same = [("L['input_ids']", "int64", (3, 8))]
    assert input_shape_mismatch_hint([same, same]) == ""
    text = input_shape_mismatch_hint([same, [("L['input_ids']", "int64", (2, 8))]])
    assert "L['input_ids'] is int64[3, 8] on rank 0 but int64[2, 8] on rank 1 (rows per rank: 3, 2)" in text
    assert "equal per-rank batch shapes" in text and "drop_last=True" in text and "5 rows over 2 ranks" in text
    other = input_shape_mismatch_hint([same, [("L['input_ids']", "int64", (3, 9))]])
    assert "int64[3, 9] on rank 1" in other and "rows per rank" not in other


class _Broken(nn.Module):
    """Two linears with a graph break between them: the second graph's input requires grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def _sgd(model, fn, x, y, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        loss = ((fn(x) - y) ** 2).mean()
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _assert_same_steps(got, want):
    """Per step: the loss and every parameter's gradient equal to TOL."""
    for (l1, g1), (l2, g2) in zip(got, want, strict=True):
        assert l1 == pytest.approx(l2, abs=TOL)
        for n in g2:
            torch.testing.assert_close(g1[n], g2[n], atol=TOL, rtol=0, msg=n)


def test_graph_break_warns_and_gradients_cross_it():
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    model, ref = _Broken(), _Broken()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _sgd(model, torch.compile(model, backend=adaptdist.backend(plan="dp")), x, y)
    want = _sgd(ref, ref, x, y)
    _assert_same_steps(got, want)  # a.* only right if the gradient crosses the break
    msgs = [str(w.message) for w in caught if issubclass(w.category, GraphBreakWarning)]
    assert len(msgs) == 1 and "1 graph break(s)" in msgs[0] and "test_dynamo_backend.py" in msgs[0], msgs


class _TwoBreaks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        h = torch.tanh(self.b(h))
        torch._dynamo.graph_break()
        return self.c(h)


def test_one_warning_names_every_graph_break():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    model, ref = _TwoBreaks(), _TwoBreaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _sgd(model, torch.compile(model, backend="adaptdist"), x, y)
    want = _sgd(ref, ref, x, y)
    _assert_same_steps(got, want)
    msgs = [str(w.message) for w in caught if issubclass(w.category, GraphBreakWarning)]
    assert len(msgs) == 1, msgs
    assert "2 graph break(s)" in msgs[0] and msgs[0].count("test_dynamo_backend.py:") == 2, msgs


def test_fullgraph_makes_a_break_an_error():
    torch._dynamo.reset()
    model = _Broken()
    with pytest.raises(Exception, match="graph_break|graph break"):
        torch.compile(model, backend="adaptdist", fullgraph=True)(torch.randn(2, 6))


def test_symbolic_shapes_are_refused_clearly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    fn = torch.compile(model, backend=adaptdist.backend(plan="dp"))
    fn(torch.randn(4, 6)).sum().backward()
    with pytest.raises(Exception, match="dynamic=False"):
        fn(torch.randn(5, 6)).sum().backward()  # a second batch size: Dynamo retraces with a symbolic size
    static = torch.compile(model, backend=adaptdist.backend(plan="dp"), dynamic=False)
    static(torch.randn(5, 6)).sum().backward()


@pytest.mark.parametrize("kwargs, match", [
    (dict(plan="nonsense"), "plan='nonsense'"),
    (dict(plan=5), "takes 'auto'"),
    (dict(cluster="missing.yaml"), "no such file"),
    (dict(cluster=5), "cluster file path"),
    (dict(constraints="blah"), "constraints"),
    (dict(constraints={"pins": 5}), "pins"),
    (dict(mesh=(3, 5)), "mesh"),
    (dict(mesh="nonsense"), "AXIS=SIZE"),
    (dict(optimizer="lion"), "optimizer='lion'"),
])
def test_bad_backend_arguments_fail_where_they_are_written(kwargs, match):
    with pytest.raises(adaptdist_errors.UsageError, match=match):
        adaptdist.backend(**kwargs)


def test_dropout_in_training_mode_trains():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5), nn.Linear(64, 3)).train()
    fn = torch.compile(model, backend=adaptdist.backend(plan="auto"))
    h = torch.compile(model[:2], backend=adaptdist.backend(plan="dp"))(torch.randn(8, 6))
    assert 0.3 < (h == 0).float().mean().item() < 0.7  # half the activations dropped
    loss = fn(torch.randn(8, 6)).pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_backend_by_name_needs_no_import_and_equals_eager():
    """``backend="adaptdist"`` resolves through the torch_dynamo_backends entry point."""
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("adaptdist").__module__ == "adaptdist.compiler.dynamo_backend"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    got = _sgd(model, torch.compile(model, backend="adaptdist"), x, y)
    want = _sgd(ref, ref, x, y)
    _assert_same_steps(got, want)
    assert adaptdist.full_state_dict(model).keys() == ref.state_dict().keys()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adaptdist_launch_runs_the_example_script(tmp_path):
    """``adaptdist launch`` starts a torchrun-style script on local ranks: the README's backend example."""
    import json
    from pathlib import Path

    from adaptdist.cli import main
    from adaptdist.models.gpt import GPT, GPTConfig

    script = Path(__file__).resolve().parent.parent / "examples" / "compile_backend.py"
    assert main(["launch", "--nproc", "2", str(script), "--plan", "fsdp", "--steps", "12",
                 "--out", str(tmp_path)]) == 0
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    full = GPT(GPTConfig(dim=64, num_layers=2, num_heads=4, max_seq_len=64))
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in full.state_dict().items()}
    for run in runs:
        assert run["local_numel"] < sum(p.numel() for p in full.parameters())  # each rank holds shards
        assert sum(run["losses"][-4:]) / 4 < run["losses"][0] - 0.5  # it learns
    assert main(["launch", str(tmp_path / "missing.py")]) == 2


def test_shapes_in_backend_errors_are_one_ranks():
    """The backend captures every rank's forward at once, with a leading rank dim; the shapes that error
    messages show (graph_meta.shape_str, used by the passes and the planner) are one rank's."""
    from adaptdist import graph_meta as gmeta
    from adaptdist.compiler.dynamo_capture import capture_all_ranks, classify_inputs

    seen = {}

    def capture_only(gm, example_inputs):
        seen["captured"], _ = capture_all_ranks(gm, classify_inputs(gm, example_inputs), 2)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 2), nn.Tanh())  # 2 outputs = the world size: no confusion either way
    torch.compile(model, backend=capture_only, dynamic=False)(torch.randn(5, 6))
    graph = seen["captured"].gm.graph
    x = next(n for n in graph.find_nodes(op="placeholder") if gmeta.get_role(n) == "batch")
    assert gmeta.shape_str(x) == "float32[5, 6] per rank"
    tanh = next(n for n in graph.nodes if n.target == torch.ops.aten.tanh.default)
    assert gmeta.shape_str(tanh) == "float32[5, 2] per rank"
    weight = next(n for n in graph.find_nodes(op="placeholder") if gmeta.get_fqn(n) == "0.weight")
    assert gmeta.shape_str(weight) == "float32[2, 6]"
    grads = [n for n in graph.output_node().args[0] if isinstance(n, torch.fx.Node) and n.target != torch.ops.aten.tanh.default]
    assert all("per rank" not in gmeta.shape_str(g) for g in grads if list(gmeta.val(g).shape) in ([2, 6], [2]))


def test_rank0_logs_one_line_per_compiled_graph_and_no_traces(caplog, capfd):
    """What the backend chose is one INFO line per graph (plan, mesh, predicted step and memory, compile time);
    a successful compile prints nothing else of its internals."""
    import logging

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with caplog.at_level(logging.INFO, logger="adaptdist"):
        fn = torch.compile(model, backend="adaptdist", dynamic=False)
        fn(torch.randn(5, 6)).sum().backward()
        fn(torch.randn(4, 6)).sum().backward()  # a second graph (another batch size)
    lines = [r.getMessage() for r in caplog.records if "compiled graph" in r.getMessage()]
    assert len(lines) == 2, lines
    for line in lines:
        assert "mesh dp=1" in line and "predicted step" in line and " ms" in line and " MiB" in line, line
        assert "compiled in" in line and "plan '" in line, line
    err = capfd.readouterr().err
    assert "Traceback" not in err and "While executing" not in err, err


def test_graph_break_summary_counts_agree_with_the_total():
    """The count of the warning is the sum of the counts it lists (GPT-2 once read '3 graph break(s), ... (x2);
    ...: reason (x3)'); one entry per site, with its reason."""
    from adaptdist.compiler.dynamo_backend import graph_break_summary

    breaks = {("after gpt2.py:698", "logging"): 1, ("after loss.py:42", "logging"): 1,
              ("after a.py:3", "print"): 2, ("after a.py:3", "data-dependent"): 1}
    total, where = graph_break_summary(breaks)
    assert total == 5
    counts = [int(c) for c in re.findall(r"(?:^|; )(\d+) after", where)]
    assert sum(counts) == total and len(counts) == 3, where
    assert "2 after" not in where and "3 after a.py:3 (reason: print (x2); data-dependent (x1))" in where, where
    assert "1 after gpt2.py:698 (reason: logging)" in where, where
    assert graph_break_summary({}) == (0, "")


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
@pytest.mark.parametrize("name,plan", [("llama", "fsdp"), ("gpt2", "dp")])
def test_hugging_face_models_retrace_for_eval_and_new_shapes(name, plan, ranks2):
    """Hugging Face LLaMA under fsdp (its forward is a decorator's frame: the placeholder swaps must still run
    around it) and GPT-2 under dp (its loss graph after a break has no parameter: under no_grad it runs as it
    is): an SGD step, an evaluation under no_grad, an SGD step at a new batch size, all equal to eager."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    from backend_workers import hf_causal_lm, hf_retrace_batch

    results = _part(ranks2, f"retrace_{name}")
    model = hf_causal_lm(name)
    x = hf_retrace_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want_loss, want_grads, want_eval = [], [], []
    for k in (4, 2):
        rows = [x[4 * r:4 * r + k] for r in range(2)]
        losses = [model(input_ids=t, labels=t).loss for t in rows]
        (sum(losses) / 2).backward()
        want_loss.append([v.item() for v in losses])
        want_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if not want_eval:
            with torch.no_grad():
                want_eval = [model(input_ids=t, labels=t).loss.item() for t in rows]
    for r in range(2):
        got = results[r]
        for step in range(2):
            assert got["loss"][step] == pytest.approx(want_loss[step][r], abs=TOL), (r, step)
            for n, g in want_grads[step].items():
                torch.testing.assert_close(got["grads"][step][n], g, atol=TOL, rtol=0, msg=f"rank {r} step {step} {n}")
        assert got["eval"] == pytest.approx(want_eval[r], abs=TOL), r
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["state"][n], p.detach(), atol=TOL, rtol=0, msg=f"rank {r} {n}")


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_backend_with_shared_memory_collectives_equals_eager(ranks2):
    """adaptdist.backend(comm="shm"): the programs' collectives run on the shm kernels (dp, fsdp), and each rank's
    losses, gradients and SGD-updated parameters equal eager's."""
    if not adaptdist.kernels.available():
        pytest.skip(f"the shm kernels are not built here: {adaptdist.kernels.load_error()}")
    results = _part(ranks2, "shm")
    _assert_cases_equal_eager(SHM_CASES, results, 2)
    for k in range(len(SHM_CASES)):
        calls = results[0][k]["collectives"][0]
        assert calls and all(c.startswith("adaptdist.shm_") for c in calls), calls


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_ranks_that_diverge_after_the_first_step_stop_with_a_typed_error(ranks2):
    """Issue 14: a branch on data taken alike at step 0 and differently at step 1 (only rank 1 compiles the other
    side), and a smaller batch on rank 1 at step 1 (only rank 1 recompiles): every rank stops at step 1 with a
    RankDivergenceError naming the ranks, the frame and the fix, at once (no SIGABRT, no wait for the timeout;
    the 2-rank launch's collectives would wait 180 s); the smaller batch, a RankInputMismatchError (a
    RankDivergenceError) naming the input and both shapes. The ranks go on to the launch's next part after it."""
    results = _part(ranks2, "divergence")
    for r in (0, 1):
        for case, (error, done, seconds) in results[r].items():
            kind = "RankDivergenceError" if case == "branch" else "RankInputMismatchError"
            assert done == 1 and error.startswith(f"{kind}: "), (r, case, error)
            assert seconds < 30, (r, case, seconds)  # well within the collective timeout (180 s here)
            assert "rank 1: about to compile a new graph for frame" in error, (r, case, error)
            # dp's forward communicates nowhere, so rank 0 meets rank 1 at its backward's announcement
            assert "rank 0: about to run the backward of graph" in error, (r, case, error)
            assert f"(this is rank {r})" in error, (r, case, error)
        branch = results[r]["branch"][0]
        assert "torch_dynamo_resume_in_forward_at_" in branch and "after its graph break at line" in branch, branch
        assert "torch.where(cond, a, b)" in branch, branch
        shape = results[r]["shape"][0]
        assert "Dynamo compiles this frame again" in shape and "drop_last=True" in shape, shape
        assert "L['x'] is float32[4, 12] on rank 0 but float32[3, 12] on rank 1" in shape, shape


def test_a_skipped_frame_in_an_installed_package_is_told_apart_from_the_users():
    from adaptdist.compiler.dynamo_backend import _in_installed_package

    lib = "recursively_install_hooks (/venv/lib/python3.11/site-packages/transformers/utils/output_capturing.py line 156)"
    assert _in_installed_package(lib)
    assert not _in_installed_package("forward (/home/me/model.py line 12)")
