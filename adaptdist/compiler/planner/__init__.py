"""The global planner: mesh shape and per-node strategies by an ILP (see :mod:`.search`)."""

from .problem import Constraints
from .search import MeshCandidate, PlannerResult, mesh_candidates, plan_auto

__all__ = ["Constraints", "MeshCandidate", "PlannerResult", "mesh_candidates", "plan_auto"]
