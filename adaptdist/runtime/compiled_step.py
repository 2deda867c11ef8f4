"""Run a compiled Dynamo graph as this rank's forward and backward programs (the torch.compile backend).

:class:`CompiledStep` is what the backend returns to Dynamo: called with the graph's inputs (this
rank's parameters, buffers and its own user inputs), it

1. on its first call, gives each parameter the plan shards this rank's shard as its data, so the
   optimizer (built before or after) holds and updates only the shard, and its state is sharded too
   (the backend removed Dynamo's size guards on those parameters: the graph stays the one traced for
   the full shapes; :func:`~adaptdist._torch_compat.drop_tensor_guards`);
2. gathers the user inputs of the ranks whose rows this rank's program reads (the ranks of its
   model-parallel group: tensor parallelism needs their batches on every rank of the group);
3. runs the forward program, writes the buffers it updates (BatchNorm's running statistics) into the
   user's buffers, and returns this rank's own rows of the outputs;
4. at ``backward()``, gathers the outputs' gradients the same way, runs the backward program, and
   returns the parameters' gradients (this rank's shard, divided by the world size: DDP averages over
   ranks) and the user inputs' gradients (this rank's own rows).

:class:`ShardLayout` (on each sharded parameter, ``param._adaptdist_layout``) records where every
rank's shard lies in the full tensor; :func:`full_state_dict` uses it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _torch_compat as compat
from . import graph_agreement
from ..program import SplitProgram
from .sharded_params import ShardedStateWarning, accumulate_grad, layout_of, shard_parameter
from ..errors import AdaptdistError

log = logging.getLogger(__name__)


@dataclass
class ShardLayout:
    """Where each rank's shard of one parameter lies: ``ranges[r][d] = [start, stop)`` of dim ``d`` on
    rank ``r`` (torch.chunk along the mesh axes in lowering order); ``placements`` per mesh axis;
    ``plan_json`` the plan that sharded it (a later graph meeting the parameter keeps its layout)."""

    fqn: str
    global_shape: tuple[int, ...]
    placements: dict[str, str]
    ranges: list[list[list[int]]]
    plan_json: str = ""
    shard: torch.Tensor | None = None  # this rank's shard, once the parameter is sharded
    grad: torch.Tensor | None = None  # the shard's gradient, set aside while the module runs
    # an expert of a ModuleList held stacked (compiler/dynamo_expert_lists.py): each rank holds it whole or not at
    # all (empty on dim 0), which no DTensor placement describes; checkpoints save it from the ranks that hold it
    whole_or_none: bool = False

    def held_whole(self, rank: int) -> bool:
        """Whether rank ``rank``'s shard is the whole tensor."""
        return all(hi - lo == n for (lo, hi), n in zip(self.ranges[rank], self.global_shape))

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (a copy, contiguous)."""
        t = full
        for d, (lo, hi) in enumerate(self.ranges[rank]):
            t = t.narrow(d, lo, hi - lo)
        return t.contiguous().clone()

    def gather(self, shard: torch.Tensor, group: Any = None) -> torch.Tensor:
        """The full tensor from every rank's ``shard`` (a collective over ``group``, default the world).

        Shards are padded to the largest one's shape (uneven chunks, empty shards) and all_gathered.
        """
        world = dist.get_world_size(group)
        biggest = [max(r[d][1] - r[d][0] for r in self.ranges) for d in range(len(self.global_shape))]
        pad = torch.zeros(biggest, dtype=shard.dtype, device=shard.device)
        pad[tuple(slice(0, s) for s in shard.shape)] = shard
        parts = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(parts, pad, group=group)
        full = torch.empty(self.global_shape, dtype=shard.dtype, device=shard.device)
        for r, part in enumerate(parts):
            box = tuple(slice(lo, hi) for lo, hi in self.ranges[r])
            full[box] = part[tuple(slice(0, hi - lo) for lo, hi in self.ranges[r])]
        return full


@dataclass
class RankIO:
    """How this rank's program reads and writes the stacked ``[W, ...]`` per-rank tensors: it holds rows
    ``[first_row, first_row + rows)``, which are the user inputs of the ranks of the process group named
    ``group_name`` (torch's ``ProcessGroup.group_name``; None: just this rank), this rank's own row being
    ``own_row``. The group is held by name, not by object: see :attr:`CompiledStep.process_groups`."""

    first_row: int
    rows: int
    own_row: int
    group_name: str | None


class CompiledStep:
    """This rank's compiled forward/backward of one Dynamo graph (module docstring).

    Args:
        split: the rank's program split into forward and backward (:mod:`adaptdist.compiler.partition`).
        kinds: per Dynamo placeholder, ``param``, ``buffer`` or ``input``.
        state_order: per program state input (params, frozen params, buffers in the program's order), the
            Dynamo placeholder index it comes from, or for ModuleList experts held stacked
            (:mod:`adaptdist.compiler.dynamo_expert_lists`) the list of their members' indices, in expert order.
        input_order: Dynamo placeholder indices of the user inputs, in the program's batch order.
        grad_params: Dynamo placeholder indices of the parameters whose gradients the program returns, in
            its ``grad:`` output order (a list of members for a stacked one: its gradient is split into theirs).
        layouts: sharded parameters by Dynamo placeholder index.
        io: the row layout of this rank.
        world_size: ``W`` (gradients of parameters are divided by it).
        tangent_outputs: indices of the outputs that take a gradient (the program's tangent inputs).
        grad_inputs: per ``grad_in:k`` output of the program, the user input (program batch index) it is for.
        rank: this rank.
        program: the whole (unsplit) RankProgram, for inspection (``mesh``, ``collectives()``).
        expert_rows: per stacked entry of ``state_order`` (its members as a tuple), whether this rank holds each
            member (its row of the stacked value) and the shape of this rank's stacked value.
    """

    def __init__(self, split: SplitProgram, kinds: list[str], state_order: list[Any], input_order: list[int],
                 grad_params: list[Any], layouts: dict[int, ShardLayout], io: RankIO, world_size: int,
                 tangent_outputs: list[int], grad_inputs: list[int], rank: int, program: Any = None,
                 expert_rows: dict[tuple[int, ...], tuple[list[bool], tuple[int, ...]]] | None = None):
        self.split = split
        self.expert_rows = expert_rows or {}
        self.program = program
        self.kinds = kinds
        self.state_order = state_order
        self.input_order = input_order
        self.grad_params = grad_params
        self.layouts = layouts
        self.io = io
        self.world_size = world_size
        self.tangent_outputs = tangent_outputs
        self.grad_inputs = grad_inputs
        self.rank = rank
        self.calls = 0
        self.runs = None  # the backend's GraphRuns (runtime/eager_parameters.py): its graphs' parameters
        self.root_module = None  # weakref to the compiled module, where Dynamo compiled a module's forward
        self.backward_checked = False
        # collective group name -> torch's name of the process group (ProcessGroup.group_name); registered
        # again before each run, because another compiled graph (after a graph break, another model) may have
        # pointed the same names elsewhere. Names, not ProcessGroup objects: Dynamo's cache keeps this step
        # alive until the interpreter exits, and a reference to a gloo group would keep its worker threads
        # running after the user's destroy_process_group(); a worker thread that releases a finished work's
        # tensors while the interpreter finalizes needs the GIL, and Python ends such a thread from under
        # C++ code: "terminate called without an active exception" (SIGABRT) on a random rank at exit.
        self.process_groups: dict[str, str] = {}
        # called once after this graph's first backward (or at its second call, without one): the end of the
        # first step, when every graph of the step is compiled (the backend reports graph breaks there)
        self.after_first_step: Any = None
        # which graph this is, the same on every rank that compiled it (graph_agreement.graph_id), and in words
        # (its frame and lines): a forward or backward that communicates starts by checking that every rank enters
        # this graph; one that does not (a dp forward) needs no check (graph_agreement's docstring says why)
        self.graph_id = 0
        self.description = "a compiled graph"
        self.input_shapes = ""  # its user inputs (rank_input_shapes.input_shapes_text), told on a divergence
        gathers = io.group_name is not None
        self.forward_communicates = gathers or _has_collective(split.forward)
        self.backward_communicates = gathers or _has_collective(split.backward)

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.program.mesh)

    def collectives(self) -> list[str]:
        """The collectives of this rank's program, in order (``op(group, numel)``)."""
        return self.program.collectives()

    def __call__(self, *args: torch.Tensor):
        if self.forward_communicates or self.calls == 0:  # the first call broadcasts the state: a collective too
            graph_agreement.announce(graph_agreement.FORWARD, self.graph_id,
                                     lambda: graph_agreement.unit_text(graph_agreement.FORWARD, self.description),
                                     lambda: self.input_shapes)
        if self.calls == 0:
            if self.world_size > 1 and torch.is_grad_enabled():
                _refuse_eager_parameters(args)
            self._broadcast_state(args)
            self._shard_parameters(args)
        elif self.calls == 1:
            self.first_step_done()
        if self.runs is not None:
            self.runs.count += 1
            if self.calls == 0:
                self.runs.param_ids.update(id(a) for a, k in zip(args, self.kinds) if k == "param")
        self.calls += 1
        differentiable = _flat(self.grad_params) + [self.input_order[k] for k in self.grad_inputs]
        # no backward will come under no_grad() (an eval loop): the forward then keeps nothing for it
        keep = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        outs = _StepFunction.apply(self, differentiable, keep, *args)
        return tuple(outs)

    def first_step_done(self) -> None:
        if self.after_first_step is not None:
            callback, self.after_first_step = self.after_first_step, None
            callback()

    def _broadcast_state(self, args: Sequence[torch.Tensor]) -> None:
        """Give every rank rank 0's parameters and buffers (in place, before any is sharded), as DDP does at
        construction: ranks that built their models with different initial weights (seeded by rank, or not
        seeded) would otherwise train different models, or, under a sharded plan, a mix of every rank's
        shards. A collective over the world (every rank makes this graph's first call: the backend checked
        they compiled the same graph). Parameters an earlier graph sharded are in sync already and skipped.
        A rank whose tensors differed says so in one INFO line naming the first of them."""
        if self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        fqns = self.program.input_fqns if self.program is not None else [str(i) for i in self.state_order]
        named = [(f"{f}[{e}]", m) for f, i in zip(fqns, self.state_order)
                 for e, m in enumerate(i if isinstance(i, list) else [i])]
        todo = [(f, args[i]) for f, i in (named if self.expert_rows else zip(fqns, self.state_order))
                if layout_of(args[i]) is None]
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for f, t in todo:
            by_dtype.setdefault(t.dtype, []).append((f, t))
        differed: list[str] = []
        with torch.no_grad():
            for dtype in sorted(by_dtype, key=str):  # the same order on every rank
                group = by_dtype[dtype]
                flat = torch.cat([t.detach().reshape(-1) for _, t in group])
                dist.broadcast(flat, src=0)
                offset = 0
                for f, t in group:
                    part = flat[offset:offset + t.numel()].view(t.shape)
                    offset += t.numel()
                    if self.rank != 0 and not torch.equal(part, t):
                        differed.append(f)
                        t.detach().copy_(part)
        if differed:
            log.info("adaptdist: rank %d's initial %s differed from rank 0's (and %d more tensors); every rank "
                     "now holds rank 0's parameters and buffers, as under DDP", self.rank, differed[0],
                     len(differed) - 1)

    def _shard_parameters(self, args: Sequence[torch.Tensor]) -> None:
        """Give each sharded parameter this rank's shard as its data (once, in place of the full tensor)."""
        for i, layout in self.layouts.items():
            if self.kinds[i] == "param":
                shard_parameter(args[i], layout, self.rank)

    def state_input(self, args: Sequence[torch.Tensor], i: Any) -> torch.Tensor:
        """Dynamo input ``i`` (a parameter or buffer) as the program takes it: this rank's shard if sharded
        (a parameter's from its layout, as it may hold a placeholder now; a sharded buffer is sliced). For a list
        of ModuleList experts' members, the rows this rank holds, stacked (``[E_local, ...]``).

        Raises:
            AdaptdistError: a sharded buffer is neither its full shape nor this rank's shard.
        """
        if isinstance(i, list):
            held, local = self.expert_rows[tuple(i)]
            parts = [self.state_input(args, m) for m, h in zip(i, held) if h]
            return torch.stack(parts) if parts else args[i[0]].new_empty(local)
        t = args[i].detach()
        layout = self.layouts.get(i)
        if layout is None:
            return t
        if layout_of(args[i]) is not None:
            return layout_of(args[i]).shard
        local = tuple(hi - lo for lo, hi in layout.ranges[self.rank])
        if tuple(t.shape) == local:
            return t
        if tuple(t.shape) == tuple(layout.global_shape):
            return layout.local(t, self.rank)
        raise AdaptdistError(f"{layout.fqn} has shape {list(t.shape)} on rank {self.rank}, but the program was "
                             f"compiled for {list(layout.global_shape)} (this rank's shard: {list(local)})")

    # --- data movement -----------------------------------------------------------------------------

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's per-rank tensor -> the program's rows (its group's tensors stacked on a new dim 0)."""
        t = t.detach().contiguous()
        if self.io.group_name is None:
            return t.unsqueeze(0)
        parts = [torch.empty_like(t) for _ in range(self.io.rows)]
        dist.all_gather(parts, t, group=compat.resolve_process_group(self.io.group_name))
        return torch.stack(parts)

    def _use_groups(self) -> None:
        for name, group_name in self.process_groups.items():
            compat.register_process_group(name, compat.resolve_process_group(group_name))

    def own_row(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's row of a program output ``[rows, ...]`` -> ``[...]`` (a view)."""
        return t[self.io.own_row]

    def run_forward(self, args: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
        """Run the forward program: (this rank's outputs, saved values, the program's inputs)."""
        sp = self.split
        self._use_groups()
        state = [self.state_input(args, i) for i in self.state_order]
        rows = [self.gather_rows(args[i]) for i in self.input_order]
        program_inputs = state + rows  # then the tangents, which the forward never reads
        res = sp.forward(*[program_inputs[i] for i in sp.forward_inputs])
        n_out = len(sp.forward_roles)
        outs = {int(r.split(":")[1]): v for r, v in zip(sp.forward_roles, res[:n_out]) if r.startswith("out:")}
        self.write_buffers(args, {r[len("buffer:"):]: v for r, v in zip(sp.forward_roles, res[:n_out])
                                  if r.startswith("buffer:")})
        return [self.own_row(outs[k]).clone() for k in sorted(outs)], list(res[n_out:]), program_inputs

    def write_buffers(self, args: Sequence[torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        """Copy the forward's new buffer values (``buffer:<fqn>`` outputs, whole: BatchNorm's running statistics,
        rank 0's under DDP's semantics) into the user's buffers, in place, as the eager forward updates them."""
        if not new:
            return
        index = dict(zip(self.program.input_fqns, self.state_order))
        with torch.no_grad():
            for fqn, value in new.items():
                args[index[fqn]].copy_(value)

    def run_backward(self, program_inputs: list[torch.Tensor], saved: list[torch.Tensor],
                     grads: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor]) -> tuple[list, list]:
        """Run the backward program on the outputs' gradients (``grads[k]``: this rank's ``[...]`` gradient of
        output k, None for zeros shaped like ``outputs[k]``), gathered into the program's rows. Returns the
        parameters' gradients (this rank's shards, divided by the world size) in ``grad:`` order, and the user
        inputs' gradients (this rank's rows) in ``grad_in:`` order."""
        sp = self.split
        tangents = []
        self._use_groups()
        for k in self.tangent_outputs:
            g = grads[k] if grads[k] is not None else torch.zeros_like(outputs[k])
            tangents.append(self.gather_rows(g))
        inputs = list(program_inputs) + tangents
        res = sp.backward(*saved, *[inputs[i] for i in sp.backward_inputs])
        by_role = dict(zip(sp.backward_roles, res))
        param_grads = self._member_grads([by_role[r] / self.world_size for r in sp.backward_roles
                                          if r.startswith("grad:")])
        input_grads = [self.own_row(by_role[f"grad_in:{k}"]) for k in range(len(self.grad_inputs))]
        return param_grads, input_grads


    def _member_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The program's parameter gradients in ``grad_params`` order, each stacked experts' gradient split into
        its members' (a held member's row; an empty gradient for a member another rank holds)."""
        if not self.expert_rows:
            return grads
        out = []
        for i, g in zip(self.grad_params, grads):
            if not isinstance(i, list):
                out.append(g)
                continue
            held, _ = self.expert_rows[tuple(i)]
            rows = iter(g.unbind(0))
            for m, h in zip(i, held):
                if h:
                    out.append(next(rows))
                else:
                    shape = [hi - lo for lo, hi in self.layouts[m].ranges[self.rank]]
                    out.append(g.new_zeros(shape))
        return out


def _has_collective(gm: Any) -> bool:
    """Whether a program part issues a collective (a functional collective or an adaptdist shared-memory one)."""
    from ..comm_transport import is_shm_collective

    return any(n.op == "call_function" and (compat.is_functional_collective(n.target) or is_shm_collective(n.target))
               for n in getattr(getattr(gm, "graph", None), "nodes", ()))


def _flat(entries: list[Any]) -> list[int]:
    """Dynamo input indices, a stacked entry's members in its place."""
    return [m for i in entries for m in (i if isinstance(i, list) else [i])]


def _refuse_eager_parameters(args: Sequence[Any], limit: int = 100_000) -> None:
    """Refuse inputs of this graph computed by eager code that used parameters: code between graphs that
    Dynamo ran eagerly (a graph break at a call into torch's own modules runs the whole call eagerly, e.g.
    BatchNorm with ``momentum=None``) never reaches the backend, so on several ranks those parameters'
    gradients would never be reduced. Walks each non-leaf input's autograd graph back to the compiled graphs
    before it (``_StepFunctionBackward``), at most ``limit`` nodes.

    Raises:
        CaptureError: names the input, the parameters' shapes, the graph breaks seen and what to try.
    """
    from ..errors import CaptureError

    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor) or a.grad_fn is None:
            continue
        todo, seen, found = [a.grad_fn], set(), []
        while todo and len(seen) < limit:
            fn = todo.pop()
            if fn is None or fn in seen or type(fn).__name__ == "_StepFunctionBackward":
                continue
            seen.add(fn)
            leaf = getattr(fn, "variable", None)  # AccumulateGrad: a leaf that receives a gradient
            if isinstance(leaf, nn.Parameter):
                found.append(leaf)
            todo.extend(f for f, _ in fn.next_functions)
        if found:
            breaks = "; ".join(f"{site} ({reason.splitlines()[0]})" for site, reason in compat.graph_break_sites())
            shapes = ", ".join(str(list(p.shape)) for p in found[:4])
            raise CaptureError(
                f"input {i} of a compiled graph ({list(a.shape)}) was computed by code that ran eagerly, outside "
                f"every adaptdist graph, using {len(found)} parameter(s) ({shapes}): their gradients would never be "
                "reduced across ranks. Graph breaks so far: " + (breaks or "none recorded") + ". A break at a call "
                "into a torch module runs the whole module eagerly (BatchNorm with momentum=None reads "
                "float(num_batches_tracked)): give it a numeric momentum, or remove the break "
                "(TORCH_LOGS=graph_breaks shows it)")


class _StepFunction(torch.autograd.Function):
    """Autograd's view of one compiled step: inputs = the Dynamo graph's inputs, outputs = its outputs."""

    @staticmethod
    def forward(ctx, step: CompiledStep, differentiable: list[int], keep: bool, *args: torch.Tensor):
        # the program's casts are explicit ops (traced under the caller's autocast): run it as it is, not cast again
        with compat.autocast_disabled():
            outs, saved, program_inputs = step.run_forward(args)
        ctx.step = step
        ctx.differentiable = differentiable
        ctx.num_args = len(args)
        ctx.program_inputs = program_inputs if keep else None
        ctx.saved = saved if keep else None
        ctx.sharded = {i: args[i] for i in step.layouts if step.kinds[i] == "param"}
        ctx.output_shapes = [(o.shape, o.dtype, o.device) for o in outs]
        for k, o in enumerate(outs):
            if k not in step.tangent_outputs:
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        step: CompiledStep = ctx.step
        like = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.output_shapes]
        if step.backward_communicates:
            graph_agreement.announce(graph_agreement.BACKWARD, step.graph_id,
                                     lambda: graph_agreement.unit_text(graph_agreement.BACKWARD, step.description),
                                     lambda: step.input_shapes)
        with compat.autocast_disabled():
            param_grads, input_grads = step.run_backward(ctx.program_inputs, ctx.saved, grads, like)
        ctx.saved = ctx.program_inputs = None
        if not step.backward_checked and step.runs is not None:
            from .eager_parameters import refuse_eager_trained_parameters

            step.backward_checked = True
            refuse_eager_trained_parameters(step.root_module() if step.root_module is not None else None, step.runs)
        step.first_step_done()
        out: list[torch.Tensor | None] = [None] * ctx.num_args
        for i, g in zip(ctx.differentiable, param_grads + input_grads):
            if i in ctx.sharded:  # the shard's gradient goes to .grad directly: autograd expects the full shape
                accumulate_grad(ctx.sharded[i], g)
            else:
                out[i] = g
        return (None, None, None, *out)


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The model's ordinary, unsharded state dict (detached copies), on every rank (or only on rank 0:
    other ranks get None). Keys are those of the model you passed to ``torch.compile`` (a compiled
    wrapper's ``_orig_mod.`` prefix is dropped). Parameters the backend sharded are all_gathered: a
    collective, which every rank must call.

    Raises:
        AdaptdistError: a sharded parameter's layout does not match the process group's world size.
    """
    inner = getattr(model, "_orig_mod", model)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardedStateWarning)
        state = inner.state_dict(keep_vars=True)
    for name, t in state.items():
        layout = getattr(t, "_adaptdist_layout", None)
        if layout is None:
            out[name] = t.detach().clone()
            continue
        if not dist.is_initialized() or dist.get_world_size() != len(layout.ranges):
            raise AdaptdistError(f"parameter {name} was sharded over {len(layout.ranges)} ranks; call "
                                 "full_state_dict on every rank of that job, with its process group alive")
        out[name] = layout.gather(t.detach())
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return None
    return out
