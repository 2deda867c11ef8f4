"""``--mesh`` axis names checked against the plan that will use them, at argument parsing (before any capture,
planning or change to ``--out``).

Axis names mean something only to a plan: the automatic planner splits the batch on ``dp`` and shards the model on
``tp`` (``tp2``, ``tp3``); a preset names its own (``dp``, ``fsdp`` -> ``dp``, ``tp``, ``dp,tp``, ``ep``); ``pp`` is
the pipeline axis, the others then form the preset inside the stages; a plan file (YAML ``mesh: [...]``, a saved
``plan.json``) names its own axes and is checked against ``--mesh`` when it is read. An axis no plan uses (``--mesh
foo=2`` under ``--plan auto``) would otherwise be taken as a model axis with nothing on it: every rank computing the
whole batch ("batch replicated") without a word.
"""

from __future__ import annotations

from ..errors import UsageError

PRESET_AXES: dict[str, tuple[str, ...]] = {"dp": ("dp",), "fsdp": ("dp",), "tp": ("tp",), "dp,tp": ("dp", "tp"),
                                           "ep": ("ep",)}
"""The mesh axes of each ``--plan`` preset (:meth:`adaptdist.annotations.ManualPlan.parse`; a test keeps them equal)."""
STAGE_AXES = ("dp", "tp")
"""The axes a pipeline mesh may have beside ``pp`` under ``--plan pp``/``auto``: they form the preset inside the stages
(``pp=2,dp=2`` -> ``dp``; ``pp=2,dp=2,tp=2`` -> ``dp,tp``)."""


def check_mesh_axes(mesh: str | None, plan: str | None) -> None:
    """Refuse a ``--mesh`` axis that ``--plan`` (None: ``auto``) has no use for.

    Raises:
        UsageError: a malformed ``--mesh`` (:meth:`~adaptdist.mesh.Mesh.parse`), or an axis the plan does not use;
            names the axis, the plan and the axes it knows.
    """
    if not mesh:
        return
    from ..compiler.planner.search import BATCH_AXIS, MODEL_AXES
    from ..mesh import Mesh
    from ..plan import PIPELINE_AXIS

    names = Mesh.parse(mesh).names
    plan = (plan or "auto").replace(" ", "")
    if plan not in PRESET_AXES and plan not in ("auto", "pp"):
        return  # a plan file names its own axes (compared with --mesh when it is read); else ManualPlan.parse refuses it
    pipeline = PIPELINE_AXIS in names or plan == "pp"
    if plan in PRESET_AXES:
        known = PRESET_AXES[plan] + ((PIPELINE_AXIS,) if pipeline else ())
        meaning = f"--plan {plan} uses the mesh axes {', '.join(PRESET_AXES[plan])}"
    elif pipeline:
        known = (PIPELINE_AXIS, *STAGE_AXES)
        meaning = (f"a pipeline mesh has {PIPELINE_AXIS} (the stages) and the axes of the preset inside the stages: "
                   f"{', '.join(STAGE_AXES)}")
    else:
        known = (BATCH_AXIS, *MODEL_AXES, PIPELINE_AXIS)
        meaning = (f"the automatic planner (--plan auto) knows {BATCH_AXIS} (splits the batch), "
                   f"{', '.join(MODEL_AXES)} (shard the model) and {PIPELINE_AXIS} (pipeline stages)")
    unknown = [a for a in names if a not in known]
    if not unknown:
        return
    hint = ""
    presets = [a for a in unknown if a in PRESET_AXES and a != plan]
    if presets:
        hint = f" (for the {presets[0]} preset pass --plan {presets[0]} with --mesh {presets[0]}=N)"
    raise UsageError(f"--mesh {mesh!r}: mesh axis{'es' if len(unknown) > 1 else ''} "
                     f"{', '.join(map(repr, unknown))} mean{'' if len(unknown) > 1 else 's'} nothing to this plan: "
                     f"{meaning}{hint}; rename the axes, e.g. --mesh {','.join(f'{a}=N' for a in known[:2])}, or "
                     "write a YAML plan file that names its own axes (mesh: [...], see --plan in the README)")
