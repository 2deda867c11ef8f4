"""Pipeline schedules: per pipeline rank, the ordered list of actions of one training step.

An :class:`Action` is ``(stage, kind, microbatch)``; ``kind`` is one of

* ``F`` forward of ``stage`` on ``microbatch``;
* ``B`` its whole backward (input gradients, then weight gradients, back to back);
* ``I`` / ``W`` the input-gradient and the weight-gradient parts of the backward, apart (zero bubble only);
* ``SEND_F`` / ``RECV_F`` the activations of ``stage``'s forward to stage + 1 / from stage - 1;
* ``SEND_B`` / ``RECV_B`` the gradients of ``stage``'s backward to stage - 1 / from stage + 1.

Stages are virtual: with ``v`` stages per rank (interleaved 1F1B) there are ``num_stages = pp_size * v`` of them and
stage ``s`` runs on pipeline rank ``s % pp_size`` (torch.distributed.pipelining's "loop" placement, which the stage cut
must follow); every other schedule has one stage per rank, stage ``s`` on rank ``s``.

Where the orders come from (torch 2.13, through :mod:`adaptdist._torch_compat`):

* ``gpipe``: ``ScheduleGPipe``'s ``pipeline_order`` (all forwards, then all backwards).
* ``interleaved-1f1b``: ``ScheduleInterleaved1F1B``'s (depth first; needs ``m >= p`` here and
  ``m % max(1, m // p) == 0`` in torch: microbatches in whole rounds).
* ``zb``: ``ScheduleInterleavedZeroBubble`` on one stage per rank, i.e. ZB1P with v = 1, which is ZB-H1 of the paper
  (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's memory, ``W`` deferred into the cool-down
  bubbles (rank ``r`` defers its first ``r`` weight gradients).
* ``1f1b``: generated here, not taken from torch: ``Schedule1F1B.pipeline_order`` in torch 2.13 labels the last
  rank's forwards 1..m instead of 0..m-1 (its runtime does not use that list), and ``ScheduleInterleaved1F1B`` on one
  stage warms up with ``2(p-1-r)`` forwards, twice 1F1B's memory. The order here is PipeDream-flush / Megatron's:
  rank ``r`` runs ``min(p-1-r, m)`` forwards, then ``F, B`` pairs, then the remaining backwards. Torch's rule
  ``m >= p`` is kept.

The sends and receives are inserted by torch's ``_add_send_recv``: each send right after the action that computes its
tensor, its receive on the peer at the same point of one global order of all ranks' actions. Executing every rank's
list in that global order matches each send with its receive as a pair, so the lists terminate even when a send
blocks until the peer receives (rendezvous semantics, the strictest); :func:`check_deadlock_free` proves it for given
numbers by simulating every rank with such blocking sends and receives. The runtime (``runtime/pipeline_executor.py``)
runs the lists as given with ``torch.distributed`` point-to-point ops, posted (``isend``/``irecv``; a receive waited
for right before its use, which needs less than the rendezvous here: its module docstring); torch's own schedule
classes are not used to run our stages because they drive ``PipelineStage`` objects through autograd
(``stage.backward_one_chunk``), while a
:class:`~adaptdist.stage_program.StageProgram` has its backward as an explicit graph (``backward_input`` /
``backward_weight``) and its gradients arrive as outputs, not in ``.grad``.

No module-level mutable state: every function computes its lists afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PipelineScheduleError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb")
"""The schedule names ``--schedule`` accepts."""

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` (see the module docstring) of virtual ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        assert self.kind in COMPUTE_KINDS + COMM_KINDS, self.kind

    def __str__(self) -> str:  # torch's notation: 1F0, 0SEND_B3
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @property
    def peer_stage(self) -> int | None:
        """The stage at the other end of a send or receive (None for compute)."""
        return {"SEND_F": self.stage + 1, "RECV_F": self.stage - 1, "SEND_B": self.stage - 1,
                "RECV_B": self.stage + 1}.get(self.kind)


def stages_per_rank(schedule: str) -> int:
    """How many virtual stages each pipeline rank holds by default: 2 for ``interleaved-1f1b``, else 1."""
    return 2 if schedule == "interleaved-1f1b" else 1


def stage_rank(stage: int, pp_size: int) -> int:
    """The pipeline rank (0..pp_size-1) that runs virtual ``stage`` (loop placement)."""
    return stage % pp_size


def check_schedule(schedule: str, pp_size: int, num_microbatches: int, per_rank: int | None = None) -> int:
    """Validate the numbers before anything runs; returns the stages per rank (``per_rank`` or the default).

    Args:
        schedule: one of :data:`SCHEDULES`.
        pp_size: pipeline ranks (the ``pp`` mesh axis), >= 1.
        num_microbatches: microbatches per step.
        per_rank: virtual stages per rank (interleaved only: >= 2).

    Raises:
        PipelineScheduleError: unknown schedule; fewer microbatches than pipeline ranks for a schedule that needs as
            many (1f1b, interleaved-1f1b, zb); a count interleaved/zb cannot split into whole rounds; stages per rank
            other than 1 for a non-interleaved schedule, or below 2 for interleaved. The message names the numbers.
    """
    if schedule not in SCHEDULES:
        raise PipelineScheduleError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    v = stages_per_rank(schedule) if per_rank is None else per_rank
    if pp_size < 1 or num_microbatches < 1:
        raise PipelineScheduleError(f"schedule {schedule} needs at least 1 pipeline rank and 1 microbatch, got "
                                    f"{pp_size} ranks and {num_microbatches} microbatches")
    if schedule == "interleaved-1f1b":
        if v < 2:
            raise PipelineScheduleError(f"schedule interleaved-1f1b needs at least 2 stages per rank, got {v} (with "
                                        f"1 stage per rank use --schedule 1f1b)")
    elif v != 1:
        raise PipelineScheduleError(f"schedule {schedule} runs 1 stage per rank, got {v} ({pp_size * v} stages on "
                                    f"{pp_size} ranks); use --schedule interleaved-1f1b for several")
    if schedule != "gpipe" and num_microbatches < pp_size:
        raise PipelineScheduleError(
            f"schedule {schedule} needs at least as many microbatches as pipeline stages: {num_microbatches} "
            f"microbatches < {pp_size} stages; use --microbatches {pp_size} (or more), or --schedule gpipe")
    if schedule in ("interleaved-1f1b", "zb"):
        rounds = max(1, num_microbatches // pp_size)
        if num_microbatches % rounds:
            lo, hi = rounds * (num_microbatches // rounds), (rounds + 1) * pp_size
            raise PipelineScheduleError(
                f"schedule {schedule} runs microbatches in whole rounds: {num_microbatches} microbatches on "
                f"{pp_size} pipeline ranks make {rounds} rounds ({num_microbatches} // {pp_size}), and "
                f"{num_microbatches} % {rounds} != 0; use a multiple of {pp_size} (e.g. {lo} or {hi})")
    return v


def compute_order(schedule: str, pp_size: int, num_microbatches: int,
                  per_rank: int | None = None) -> dict[int, list[Action]]:
    """Per pipeline rank, the compute actions (F, B, I, W) of ``schedule``, in order. Raises as :func:`check_schedule`."""
    v = check_schedule(schedule, pp_size, num_microbatches, per_rank)
    if schedule == "1f1b":
        return {r: _one_f_one_b(r, pp_size, num_microbatches) for r in range(pp_size)}
    kind = {"gpipe": "gpipe", "interleaved-1f1b": "interleaved", "zb": "zero-bubble"}[schedule]
    from . import _torch_compat as compat  # here: the CLI's parser reads SCHEDULES without importing torch

    try:
        order = compat.pipelining_compute_order(kind, pp_size, num_microbatches, v)
    except ValueError as e:  # torch's own refusal, should check_schedule have missed one
        raise PipelineScheduleError(f"schedule {schedule} with {pp_size} pipeline ranks, {v} stages per rank and "
                                    f"{num_microbatches} microbatches: torch refuses it: {e}") from e
    return {r: [Action(*a) for a in acts] for r, acts in order.items()}


def _one_f_one_b(rank: int, pp_size: int, m: int) -> list[Action]:
    warmup = min(pp_size - 1 - rank, m)
    acts = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    acts += [Action(rank, "B", i) for i in range(m - warmup, m)]
    return acts


def pipeline_order(schedule: str, pp_size: int, num_microbatches: int,
                   per_rank: int | None = None) -> dict[int, list[Action]]:
    """Per pipeline rank, every action of one step in order, sends and receives included (see the module
    docstring); checked with :func:`check_deadlock_free` before it is returned.

    Raises:
        PipelineScheduleError: as :func:`check_schedule`, or the lists would deadlock (a bug: the message shows
            where every rank is stuck).
    """
    v = check_schedule(schedule, pp_size, num_microbatches, per_rank)
    compute = compute_order(schedule, pp_size, num_microbatches, v)
    num_stages = pp_size * v
    if pp_size == 1:
        order = compute
    else:
        from . import _torch_compat as compat  # here: the CLI's parser reads SCHEDULES without importing torch

        lowered = compat.pipelining_add_send_recv(
            {r: [(a.stage, a.kind, a.microbatch) for a in acts] for r, acts in compute.items()}, num_stages)
        order = {r: [Action(*a) for a in acts] for r, acts in lowered.items()}
    check_deadlock_free(order, pp_size, num_stages, num_microbatches, schedule=schedule)
    return order


def check_deadlock_free(order: dict[int, list[Action]], pp_size: int, num_stages: int, num_microbatches: int,
                        schedule: str = "?") -> None:
    """Simulate every rank's list with blocking point-to-point semantics and check it completes and is complete.

    A rank at a compute action runs it when its inputs are there (F: stage 0, or its activations received / computed
    by the local previous stage; B/I: its own F, and, except on the last stage, its output gradients received or
    computed locally; W: its I). A send and its receive complete only together, when both ranks have reached them
    (rendezvous: the strictest semantics; an eager/buffered send only relaxes it). The simulation ends when every
    list is done; a state where no rank can move is a deadlock. Afterwards every stage must have run F and B (or I
    and W) once per microbatch, and every message must have been sent and received once.

    Raises:
        PipelineScheduleError: a deadlock (each rank's stuck action and what it waits for) or a missing/duplicate
            action, naming the schedule, stages and microbatches.
    """
    where = f"schedule {schedule} ({pp_size} pipeline ranks, {num_stages} stages, {num_microbatches} microbatches)"
    pos = {r: 0 for r in order}
    done: dict[int, set[tuple[int, str, int]]] = {r: set() for r in order}

    def has(rank: int, stage: int, kind: str, mb: int) -> bool:
        return (stage, kind, mb) in done[rank]

    def ready(rank: int, a: Action) -> str | None:
        """None when compute action ``a`` can run on ``rank``, else what it waits for."""
        s, mb = a.stage, a.microbatch
        if stage_rank(s, pp_size) != rank:
            return f"stage {s} belongs to rank {stage_rank(s, pp_size)}"
        if a.kind == "F":
            if s == 0 or has(rank, s, "RECV_F", mb) or has(rank, s - 1, "F", mb):
                return None
            return f"activations of stage {s - 1} microbatch {mb}"
        if a.kind in ("B", "I"):
            if not has(rank, s, "F", mb):
                return f"its forward {s}F{mb}"
            if (s == num_stages - 1 or has(rank, s, "RECV_B", mb) or has(rank, s + 1, "B", mb)
                    or has(rank, s + 1, "I", mb)):
                return None
            return f"gradients of stage {s + 1} microbatch {mb}"
        if a.kind == "W":
            return None if has(rank, s, "I", mb) else f"its input-gradient part {s}I{mb}"
        raise AssertionError(a)

    def partner(a: Action) -> tuple[int, Action]:
        peer = a.peer_stage
        kind = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[a.kind]
        return stage_rank(peer, pp_size), Action(peer, kind, a.microbatch)

    while True:
        progress = False
        for r in sorted(order):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                if a.kind in COMPUTE_KINDS:
                    if ready(r, a) is not None:
                        break
                    done[r].add((a.stage, a.kind, a.microbatch))
                    pos[r] += 1
                    progress = True
                    continue
                if a.kind.startswith("SEND"):
                    need = "F" if a.kind == "SEND_F" else None
                    if need and not has(r, a.stage, "F", a.microbatch):
                        raise PipelineScheduleError(f"{where}: rank {r} sends {a} before computing it")
                    if a.kind == "SEND_B" and not (has(r, a.stage, "B", a.microbatch)
                                                   or has(r, a.stage, "I", a.microbatch)):
                        raise PipelineScheduleError(f"{where}: rank {r} sends {a} before computing it")
                peer, want = partner(a)
                if peer not in order or pos[peer] >= len(order[peer]) or order[peer][pos[peer]] != want:
                    break
                for rr, aa in ((r, a), (peer, want)):
                    if (aa.stage, aa.kind, aa.microbatch) in done[rr]:
                        raise PipelineScheduleError(f"{where}: rank {rr} runs {aa} twice")
                    done[rr].add((aa.stage, aa.kind, aa.microbatch))
                    pos[rr] += 1
                progress = True
        if all(pos[r] == len(order[r]) for r in order):
            break
        if not progress:
            stuck = []
            for r in sorted(order):
                if pos[r] == len(order[r]):
                    stuck.append(f"rank {r}: finished")
                    continue
                a = order[r][pos[r]]
                if a.kind in COMPUTE_KINDS:
                    stuck.append(f"rank {r}: at {a} (action {pos[r]}), waiting for {ready(r, a)}")
                else:
                    peer, want = partner(a)
                    at = order[peer][pos[peer]] if pos[peer] < len(order[peer]) else "its end"
                    stuck.append(f"rank {r}: at {a} (action {pos[r]}), waiting for rank {peer} to reach {want}; "
                                 f"rank {peer} is at {at}")
            raise PipelineScheduleError(f"{where} would deadlock with blocking send/recv:\n  " + "\n  ".join(stuck))
    for s in range(num_stages):
        r = stage_rank(s, pp_size)
        for mb in range(num_microbatches):
            full = has(r, s, "B", mb)
            split = has(r, s, "I", mb) and has(r, s, "W", mb)
            if not has(r, s, "F", mb) or full == split:
                raise PipelineScheduleError(f"{where}: stage {s} microbatch {mb} on rank {r} does not run F and "
                                            f"exactly one of B or I+W")
    for r, acts in order.items():
        if len(acts) != len(set(acts)):
            raise PipelineScheduleError(f"{where}: rank {r} repeats an action")


def format_order(order: dict[int, list[Action]]) -> str:
    """The lists one rank a line, ``rank 0: 0F0 0SEND_F0 ...`` (for logs and errors)."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in sorted(order.items()))


@dataclass(frozen=True)
class Timeline:
    """The simulated timing of one step's action lists (:func:`simulate_timeline`).

    Attributes:
        step_s: the time from the first action to the last one of any rank, seconds.
        busy_s: per pipeline rank, seconds spent computing.
        spans: per pipeline rank, ``(action, start_s, end_s)`` of each compute action, in order.
    """

    step_s: float
    busy_s: dict[int, float]
    spans: dict[int, list[tuple[Action, float, float]]]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (ranks * step_s)``."""
        return 1.0 - sum(self.busy_s.values()) / (len(self.busy_s) * self.step_s) if self.step_s else 0.0


def simulate_timeline(order: dict[int, list[Action]], pp_size: int, num_stages: int, forward_s: float = 1.0,
                      backward_input_s: float = 1.0, backward_weight_s: float = 1.0) -> Timeline:
    """Run ``order`` on a clock: every stage's F, I and W of a microbatch take ``forward_s``, ``backward_input_s`` and
    ``backward_weight_s`` seconds (B their sum; per virtual stage), messages take no time, a rank runs its list in
    order and an action starts when the rank is free and its inputs have arrived. The measured bubble of a
    schedule's real lists, beside the closed forms of ``cost_models`` (GPipe/1F1B ``(p-1)/(m+p-1)``, ...).

    Raises:
        PipelineScheduleError: the lists cannot run (see :func:`check_deadlock_free`).
    """
    cost = {"F": forward_s, "I": backward_input_s, "W": backward_weight_s, "B": backward_input_s + backward_weight_s}
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    ready_at: dict[tuple[int, str, int], float] = {}  # (stage, "F"|"G", mb) -> when its output can be used
    spans: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in order}
    while any(pos[r] < len(order[r]) for r in order):
        progress = False
        for r in sorted(order):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                s, mb = a.stage, a.microbatch
                if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    pos[r] += 1  # data dependencies carry the timing; messages are free
                    progress = True
                    continue
                deps = []
                if a.kind == "F" and s > 0:
                    deps.append((s - 1, "F", mb))
                if a.kind in ("B", "I"):
                    deps.append((s, "Fdone", mb))
                    if s < num_stages - 1:
                        deps.append((s + 1, "G", mb))
                if a.kind == "W":
                    deps.append((s, "Idone", mb))
                if any(d not in ready_at for d in deps):
                    break
                start = max([free[r]] + [ready_at[d] for d in deps])
                end = start + cost[a.kind]
                free[r] = end
                spans[r].append((a, start, end))
                if a.kind == "F":
                    ready_at[(s, "F", mb)] = ready_at[(s, "Fdone", mb)] = end
                elif a.kind == "I":
                    ready_at[(s, "G", mb)] = ready_at[(s, "Idone", mb)] = end
                elif a.kind == "B":  # the runtime sends B's gradients after the whole backward
                    ready_at[(s, "G", mb)] = ready_at[(s, "Idone", mb)] = end
                pos[r] += 1
                progress = True
        if not progress:
            check_deadlock_free(order, pp_size, num_stages, max(a.microbatch for acts in order.values()
                                                                for a in acts) + 1)
            raise PipelineScheduleError(f"the action lists cannot run:\n{format_order(order)}")
    step = max(free.values()) if free else 0.0
    return Timeline(step_s=step, busy_s={r: sum(e - b for _, b, e in spans[r]) for r in order}, spans=spans)
