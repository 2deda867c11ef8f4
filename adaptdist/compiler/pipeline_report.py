"""What a pipeline plan's ``report.html`` shows per rank, read from the lowered pipeline programs
(:class:`~adaptdist.stage_program.PipelineRankProgram`): the collectives and the stage-to-stage sends and receives
of one step with their bytes (:func:`pipeline_comm_rows`), each rank's predicted time and held state
(:func:`pipeline_rank_rows`), and which stage holds each parameter (:func:`stage_holders`).

The cost model's step estimate refuses pipeline plans (:mod:`adaptdist.cost_models.estimate`), so these are counts
and bytes from the programs themselves, with the planner's per-stage times where the plan carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

GRAPHS = ("forward", "backward_input", "backward_weight")
"""A stage's three programs, each run once per microbatch."""


@dataclass(frozen=True)
class CommRow:
    """One kind of communication of one rank per step: ``kind`` (``all_reduce``, ``send``, ``recv``...), ``peer``
    (the mesh-axis group, or the other stage's rank), ``what`` (the program or value), how many per step and
    their bytes per step."""

    kind: str
    peer: str
    what: str
    count: int
    n_bytes: int


@dataclass(frozen=True)
class RankRow:
    """One rank of a pipeline: its stages, the planner's predicted busy time per step (its stages' forward,
    backward and weight-gradient work for every microbatch plus the gradient sync), the step, and the state it
    holds (parameters, their gradients, the optimizer's state; bytes). Seconds None: the plan has no planner
    times (a manual plan)."""

    rank: int
    stages: tuple[int, ...]
    busy_s: float | None
    step_s: float | None
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def state_bytes(self) -> int:
        """Bytes of training state this rank holds through the whole step, whatever the microbatch: its stages'
        state tensors, parameters and buffers (``params_bytes``), the gradients of its trainable parameters
        (``grads_bytes``) and the optimizer's state for them (``optimizer_bytes``: the optimizer's copies per
        trainable parameter times its bytes; AdamW's two moments are 2x the gradients, plain SGD's 0). The
        activations of the microbatches in flight come on top. The report's "state MiB" column."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def _nbytes(v: Any) -> int:
    import torch

    return int(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0


def _spec_bytes(specs) -> int:
    import math

    import torch

    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs)


def pipeline_comm_rows(program: Any) -> tuple[CommRow, ...]:
    """Rank ``program``'s communication in one step: each stage program's collectives (once per microbatch), the
    activations sent to the next stage and received from the previous one, their gradients back, and the
    gradient all-reduce of each parameter held by more than one rank (once per step). Where a boundary is routed
    to peers of another data-parallel size the first peer is named. Not listed: the loss and normalizer sums over
    the batch group (a few bytes)."""
    from ..cost_models.communication import functional_collective_kind
    from ..graph_meta import get_group

    m = int(program.num_microbatches)
    acc: dict[tuple[str, str, str], list[int]] = {}

    def add(kind: str, peer: str, what: str, count: int, nbytes: int) -> None:
        a = acc.setdefault((kind, peer, what), [0, 0])
        a[0] += count
        a[1] += nbytes

    for st in program.stages:
        for g in GRAPHS:
            for n in getattr(st, g).graph.nodes:
                kind = functional_collective_kind(n.target) if n.op == "call_function" else None
                if kind is None or kind == "wait":
                    continue
                group = get_group(n) or next((a for a in n.args if isinstance(a, str) and ":" in a), "?")
                src = n.args[0] if n.args else None
                srcs = src if isinstance(src, (list, tuple)) else [src]  # a fused bucket flatten takes a list
                add(kind, str(group), f"stage {st.stage} {g}", m,
                    m * sum(_nbytes(getattr(a, "meta", {}).get("val")) for a in srcs))
        routed = " (routed)" if st.routes is not None else ""
        if st.send_to is not None:
            add("send", f"rank {st.send_to}{routed}", f"stage {st.stage} activations", m * len(st.send_specs),
                m * _spec_bytes(st.send_specs))
            add("recv", f"rank {st.send_to}{routed}", f"stage {st.stage} gradients in", m * len(st.grad_in_specs),
                m * _spec_bytes(st.grad_in_specs))
        if st.recv_from is not None:
            add("recv", f"rank {st.recv_from}{routed}", f"stage {st.stage} activations in", m * len(st.recv_specs),
                m * _spec_bytes(st.recv_specs))
            add("send", f"rank {st.recv_from}{routed}", f"stage {st.stage} gradients", m * len(st.grad_out_specs),
                m * _spec_bytes(st.grad_out_specs))
    for f in program.param_fqns:
        group = tuple(program.grad_groups.get(f, ()))
        if len(group) > 1:
            add("all_reduce", f"ranks {', '.join(map(str, group))}", "gradient sync", 1, _nbytes(program.state[f]))
    return tuple(CommRow(k, p, w, c, b) for (k, p, w), (c, b) in acc.items() if c)


def pipeline_rank_rows(programs: Mapping[int, Any], optimizer: str = "adamw") -> tuple[RankRow, ...]:
    """Each rank's :class:`RankRow`: the planner's per-microbatch times of its stage group (``predicted_s`` of the
    plan's stages; an interleaved rank's chunks carry their group's times, counted once) times the microbatches,
    plus its largest gradient sync; the state from the program's tensors, the optimizer's state as
    :func:`~adaptdist.cost_models.memory.optimizer_model` counts copies of each trained parameter."""
    from ..cost_models.memory import optimizer_model

    copies = optimizer_model(str(optimizer).replace("-", "_")).state_copies
    out = []
    for r, p in sorted(programs.items()):
        spec = p.plan.pipeline if p.plan is not None else None
        busy = step = None
        if spec is not None:
            step = spec.predicted_s.get("step")
            times = [spec.stages[st.stage].predicted_s for st in p.stages if st.stage < len(spec.stages)]
            if times and all("forward" in t for t in times):
                t = times[0] if int(getattr(spec, "stages_per_rank", 1) or 1) > 1 else None
                work = [t] if t is not None else times
                busy = (p.num_microbatches * sum(x["forward"] + x.get("backward", 0.0) + x.get("weight", 0.0)
                                                 for x in work) + max(x.get("grad_sync", 0.0) for x in work))
        params = sum(_nbytes(v) for v in p.state.values())
        grads = sum(_nbytes(p.state[f]) for f in p.param_fqns)
        out.append(RankRow(r, tuple(st.stage for st in p.stages), busy, step, params, grads, copies * grads))
    return tuple(out)


def stage_holders(programs: Mapping[int, Any]) -> dict[str, tuple[int, ...]]:
    """fqn -> the stages holding that state tensor (two for a tied weight), over every rank's program."""
    out: dict[str, set[int]] = {}
    for p in programs.values():
        for st in p.stages:
            for f in st.state_names:
                out.setdefault(f, set()).add(st.stage)
    return {f: tuple(sorted(s)) for f, s in out.items()}
