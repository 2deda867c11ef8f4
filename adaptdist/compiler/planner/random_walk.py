"""Baseline searcher: a greedy random walk over strategies, like the planner of "End-to-end Adaptive
Distributed Training on PaddlePaddle" (Ao et al., 2021, s.3.4), for comparison with the ILP.

On one axis's :class:`~.problem.AxisProblem`, from every decision at its first allowed strategy
(replicated, for most nodes), repeat: pick a decision and one of its other allowed strategies at
random, keep the change when it lowers the objective (the decision's compute plus the resharding on
its edges, the others fixed) and the memory rows still hold. It stops after ``steps`` proposals or
``time_limit_s``. Seeded, so it is deterministic; it finds a local optimum, and the ILP's proven
optimum is what it is measured against (``benchmarks/bench_planner.py``).
"""

from __future__ import annotations

import random
import time
from typing import Sequence

from .ilp import ILPResult, Infeasible
from .problem import AxisProblem


def random_walk(problem: AxisProblem, steps: int = 20000, time_limit_s: float = 30.0, seed: int = 0,
                hint: Sequence[int] | None = None, memory: bool = True) -> ILPResult:
    """Search ``problem`` as the module docstring says; returns its best choice in an :class:`ILPResult`
    (``status`` ``"local"``, bound 0: a walk proves nothing).

    Raises:
        Infeasible: the starting choice breaks a memory row and no proposal repairs it.
    """
    t0 = time.perf_counter()
    rng = random.Random(seed)
    n = len(problem.vars)
    choice = [h if hint is not None and h in v.allowed else v.allowed[0] for h, v in
              zip(hint if hint is not None else [None] * n, problem.vars)]
    incident: list[list[int]] = [[] for _ in range(n)]
    for ei, e in enumerate(problem.edges):
        incident[e.src].append(ei)
        incident[e.dst].append(ei)
    rows = len(problem.peak_steps)
    used = [problem.fixed_bytes[j] + sum(v.memory_bytes[j][choice[i]] for i, v in enumerate(problem.vars))
            for j in range(rows)]

    def local(i: int, k: int) -> float:
        v = problem.vars[i]
        t = v.compute_s[k] + v.reshard_s[k]
        for ei in incident[i]:
            e = problem.edges[ei]
            ks = k if e.src == i else choice[e.src]
            kd = k if e.dst == i else choice[e.dst]
            t += e.cost_s[e.src_of[ks]][e.dst_of[kd]]
        return t

    movable = [i for i, v in enumerate(problem.vars) if len(v.allowed) > 1]
    for step in range(steps if movable else 0):
        if step % 256 == 0 and time.perf_counter() - t0 > time_limit_s:
            break
        i = rng.choice(movable)
        v = problem.vars[i]
        k = rng.choice([a for a in v.allowed if a != choice[i]])
        new_used = [used[j] - v.memory_bytes[j][choice[i]] + v.memory_bytes[j][k] for j in range(rows)]
        over = memory and any(u > problem.capacity_bytes for u in used)
        fits = not memory or all(u <= problem.capacity_bytes for u in new_used)
        less_memory = sum(new_used) < sum(used)
        if (fits and local(i, k) < local(i, choice[i])) or (over and less_memory):
            choice[i] = k
            used = new_used
    if memory and not problem.memory_ok(choice):
        raise Infeasible("memory (the random walk found no choice that fits)")
    obj = problem.objective_s(choice)
    return ILPResult(tuple(choice), obj, 0.0, 1.0 if obj > 0 else 0.0, "local", time.perf_counter() - t0, n,
                     len(problem.edges), "random_walk")
