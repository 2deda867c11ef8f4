"""The lowering's pass pipeline, as data: one ordered tuple, run by :func:`.infra.run_pipeline` once per mesh
axis (``passes/README.md`` describes each pass; ``tests/test_pass_pipeline.py`` checks its table against
:data:`PASSES`)."""

from __future__ import annotations

from .all_reduce_extrema import all_reduce_extrema
from .batch_norm import keep_rank0_running_stats, sync_batch_norm
from .bucket_grad_allreduce import bucket_grad_allreduce
from .bucket_grad_reduce_scatter import bucket_grad_reduce_scatter
from .bucket_gathered_rows import bucket_gathered_rows
from .bucket_param_allgather import bucket_param_allgather
from .combine_partial_sums import combine_partial_sums
from .decompose_addmm import decompose_addmm
from .embedding_bag import decompose_embedding_bag
from .gather_embedding_rows import gather_embedding_rows
from .global_rng import global_rng
from .global_statistics import globalize_statistics
from .globalize_reductions import globalize_reductions
from ..errors import UsageError
from ..lowering_options import LoweringOptions
from .infra import Pass, check_disabled
from .localize_indices import localize_indices
from .insert_redistributes import insert_redistributes
from .propagate_placements import propagate_placements
from .regather_in_backward import regather_in_backward
from .relax_views import relax_views
from .vocab_parallel_embedding import vocab_parallel_embedding
from .vocab_parallel_loss import vocab_parallel_loss

PASSES: tuple[Pass, ...] = (
    decompose_addmm,
    sync_batch_norm,
    decompose_embedding_bag,
    propagate_placements,
    combine_partial_sums,
    globalize_reductions,
    globalize_statistics,
    propagate_placements,
    gather_embedding_rows,
    global_rng,
    insert_redistributes,
    all_reduce_extrema,
    localize_indices,
    keep_rank0_running_stats,
    vocab_parallel_embedding,
    vocab_parallel_loss,
    regather_in_backward,
    bucket_param_allgather,
    bucket_gathered_rows,
    bucket_grad_reduce_scatter,
    bucket_grad_allreduce,
    relax_views,
)
"""The passes of one mesh axis's lowering, in order (``propagate_placements`` runs twice)."""

SKIPPABLE: frozenset[str] = frozenset({
    "combine_partial_sums", "regather_in_backward", "bucket_param_allgather", "bucket_grad_reduce_scatter",
    "bucket_grad_allreduce", "relax_views", "gather_embedding_rows", "bucket_gathered_rows",
})
"""The passes ``disabled_passes`` may name: they change speed or memory, not the numbers (``relax_views``: a
stride error instead). Every other pass is what some sharding rule relies on to mean the single-process
step (the global-count rewrites, the extrema's all_reduce, shifted indices, the collectives themselves):
skipping one would leave wrong numbers without an error."""


def check_skippable(options: LoweringOptions) -> None:
    """Raise UsageError naming any pass of ``options.disabled_passes`` that is unknown or not in
    :data:`SKIPPABLE`."""
    check_disabled(options, PASSES)
    bad = [n for n in options.disabled_passes if n not in SKIPPABLE]
    if bad:
        raise UsageError(f"cannot skip the lowering pass{'es' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}: "
                         f"sharding rules rely on {'them' if len(bad) > 1 else 'it'} for the single-process numbers, "
                         f"so the step would compute something else without an error; passes that may be skipped "
                         f"(for debugging speed or memory): {', '.join(sorted(SKIPPABLE))}")
