"""Hand-built pipeline stage programs (tanh(x W^T + b) blocks, MSE loss, explicit backward graphs) and the worker
that runs them on gloo ranks: the executor's tests, independent of the stage cut."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from adaptdist.stage_program import PipelineRankProgram, PrologueProgram, StageProgram, TensorSpec

D = 6


class Blocks(torch.nn.Module):
    """The eager reference: ``num_stages`` blocks ``tanh(Linear(D, D))``; with ``tied`` the last block's weight is the
    first block's."""

    def __init__(self, num_stages: int, tied: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(num_stages))
        if tied:
            self.layers[-1].weight = self.layers[0].weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def mse(y, t):
    return ((y - t) ** 2).mean()


class _Fwd(torch.nn.Module):
    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last

    def forward(self, w, b, *rest):
        if self.first:
            x, _t, n = rest
        else:
            x, _x0, _t, n = rest
        y = torch.tanh(x @ w.T + b)
        if self.last:
            return ((y - _t) ** 2).sum() / (n * D), x, y, w, _t, n
        return y, x, y, w


class _BwdI(torch.nn.Module):
    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last

    def forward(self, *args):
        if self.last:
            x, y, w, t, n = args
            gy = 2 * (y - t) / (n * D)
        else:
            x, y, w, gy = args
        gz = gy * (1 - y * y)
        return ((x, gz) if self.first else (gz @ w, x, gz))


class _BwdW(torch.nn.Module):
    def forward(self, x, gz):
        return gz.T @ x, gz.sum(0)


class _Prologue(torch.nn.Module):
    def forward(self, x, t):
        return torch.tensor(float(x.shape[0]))


def build_programs(pp: int, dp: int, schedule: str, microbatches: int, rows: int, tied: bool,
                   per_rank: int = 1, seed: int = 0) -> dict[int, PipelineRankProgram]:
    """Every rank's program: rank ``pp_rank * dp + d``; stage ``s`` on pipeline rank ``s % pp``."""
    num_stages = pp * per_rank
    model = Blocks(num_stages, tied, seed)
    names = {s: (f"layers.{s}.weight", f"layers.{s}.bias") for s in range(num_stages)}
    if tied:
        names[num_stages - 1] = ("layers.0.weight", f"layers.{num_stages - 1}.bias")
    params = dict(model.named_parameters())
    world = pp * dp
    rank_of = lambda s, d: (s % pp) * dp + d  # noqa: E731
    stage_ranks = {s: tuple(rank_of(s, d) for d in range(dp)) for s in range(num_stages)}
    holders: dict[str, set[int]] = {}
    for s in range(num_stages):
        for f in names[s]:
            holders.setdefault(f, set()).update(stage_ranks[s])
    spec = TensorSpec((rows // dp // microbatches, D), torch.float32)
    out = {}
    for r in range(world):
        p_rank, d = divmod(r, dp)
        stages = []
        for s in range(p_rank, num_stages, pp):
            first, last = s == 0, s == num_stages - 1
            stages.append(StageProgram(
                stage=s, num_stages=num_stages, forward=_Fwd(first, last), backward_input=_BwdI(first, last),
                backward_weight=_BwdW(), state_names=names[s], grad_fqns=names[s],
                recv_specs=() if first else (spec,), send_specs=() if last else (spec,),
                grad_out_specs=() if first else (spec,), grad_in_specs=() if last else (spec,),
                recv_from=None if first else rank_of(s - 1, d), send_to=None if last else rank_of(s + 1, d),
                num_saved=4, num_saved_w=2))
        mine = sorted({f for st in stages for f in st.state_names})
        out[r] = PipelineRankProgram(
            rank=r, world_size=world, stages=tuple(stages),
            prologue=PrologueProgram(_Prologue(), ("sum",), ("rows",)),
            num_microbatches=microbatches, microbatch_rows=rows // dp // microbatches,
            batch_slice=(d * (rows // dp), rows // dp), schedule=schedule, stage_ranks=stage_ranks,
            batch_group=tuple(p_rank * dp + e for e in range(dp)),
            grad_groups={f: tuple(sorted(holders[f])) for f in mine}, groups={},
            state={f: params[f].detach().clone() for f in mine}, param_fqns=tuple(mine),
            loss_rank=any(st.is_last for st in stages))
    return out


def as_graph_modules(programs: dict[int, PipelineRankProgram]) -> dict[int, PipelineRankProgram]:
    """``programs`` with every module traced (make_fx on tensors of the programs' shapes) into the GraphModules the
    lowering produces, so that :func:`adaptdist.stage_program_io.save_pipeline_programs` can write them."""
    import dataclasses

    from torch.fx.experimental.proxy_tensor import make_fx

    def rnd(*shape):
        return torch.rand(shape) + 0.5

    out = {}
    for r, prog in programs.items():
        rows = prog.microbatch_rows
        stages = []
        for st in prog.stages:
            recv = () if st.is_first else (rnd(rows, D),)
            fwd_in = (rnd(D, D), rnd(D), *recv, rnd(rows, D), rnd(rows, D), rnd())
            bwd_in = (rnd(rows, D), rnd(rows, D), rnd(D, D), *((rnd(rows, D), rnd()) if st.is_last else (rnd(rows, D),)))
            stages.append(dataclasses.replace(
                st, forward=make_fx(st.forward)(*fwd_in), backward_input=make_fx(st.backward_input)(*bwd_in),
                backward_weight=make_fx(st.backward_weight)(rnd(rows, D), rnd(rows, D))))
        pro = prog.prologue
        local = prog.batch_slice[1]
        pro = dataclasses.replace(pro, module=make_fx(pro.module)(rnd(local, D), rnd(local, D)))
        out[r] = dataclasses.replace(prog, stages=tuple(stages), prologue=pro)
    return out


def pipeline_sgd_worker(cases: list[tuple], rows: int, batches: list, lr: float, steps: int,
                        timeout_s: float = 30.0) -> list[dict]:
    """For each case ``(pp, dp, schedule, microbatches, per_rank, tied)`` (all of this world size), run ``steps``
    SGD steps of this rank's hand-built program in one process group; per case: losses, grads per step, final
    params."""
    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.runtime.worker import make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        out = []
        for pp, dp, schedule, microbatches, per_rank, tied in cases:
            program = build_programs(pp, dp, schedule, microbatches, rows, tied, per_rank)[rank]
            groups = setup_pipeline_groups(program, timeout_s)
            runner = PipelineStepRunner(program, "sgd", lr, groups, timeout_s=timeout_s,
                                        make_optimizer=make_optimizer)
            losses, grads = [], []
            for s in range(steps):
                losses.append(runner.step(batches[s % len(batches)]))
                grads.append({k: v.clone() for k, v in runner.last_grads.items()})
            out.append({"losses": losses, "grads": grads,
                        "params": {f: runner.state[f].clone() for f in program.param_fqns}})
        return out
    finally:
        dist.destroy_process_group()


def dead_peer_worker(timeout_s: float = 5.0) -> str:
    """Two pipeline ranks; rank 1 exits before the step: rank 0's error text (it must name rank 1)."""
    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.runtime.worker import make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank = int(os.environ["RANK"])
    program = build_programs(2, 1, "1f1b", 2, 4, False)[rank]
    groups = setup_pipeline_groups(program, timeout_s)
    runner = PipelineStepRunner(program, "sgd", 0.1, groups, timeout_s=timeout_s, make_optimizer=make_optimizer)
    dist.barrier()
    if rank == 1:
        return "gone"  # never runs its step (and never destroys the group)
    x = torch.randn(4, D)
    try:
        runner.step((x, x))
    except Exception as e:  # noqa: BLE001 -- the test inspects the text
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    return "no error"


def lowered_pipeline_worker(program_dirs: list[str], batches: list, lr: float, steps: int,
                            timeout_s: float = 60.0, max_grad_norms: list | None = None) -> list[dict]:
    """For each directory of saved pipeline programs (pp-core's lowering), run ``steps`` SGD steps of this rank's
    program in one process group (gradients clipped to the directory's entry of ``max_grad_norms`` unless None);
    per directory: losses, grads per step (clipped), final params, the gradient norm of each step."""
    from adaptdist.runtime.pipeline_executor import PipelineStepRunner, setup_pipeline_groups
    from adaptdist.runtime.worker import make_optimizer
    from adaptdist.runtime.pipeline_programs import _box
    from adaptdist.stage_program_io import load_pipeline_program

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        rank = int(os.environ["RANK"])
        out = []
        for i, d in enumerate(program_dirs):
            program = load_pipeline_program(d, rank, dist.get_world_size())
            max_grad_norm = max_grad_norms[i] if max_grad_norms else None
            runner = PipelineStepRunner(program, "sgd", lr, setup_pipeline_groups(program, timeout_s),
                                        timeout_s=timeout_s, make_optimizer=make_optimizer,
                                        max_grad_norm=max_grad_norm)
            losses, grads, norms = [], [], []
            for s in range(steps):
                losses.append(runner.step(batches[s % len(batches)]))
                grads.append({k: v.clone() for k, v in runner.last_grads.items()})
                norms.append(runner.last_grad_norm)
            boxes = {f: _box(program, f, tuple(program.global_shapes.get(f, program.state[f].shape)))
                     for f in program.param_fqns}
            out.append({"losses": losses, "grads": grads, "boxes": boxes, "norms": norms,
                        "params": {f: runner.state[f].clone() for f in program.param_fqns}})
        return out
    finally:
        dist.destroy_process_group()
