"""The node.meta keys adaptdist reads and writes, with typed helpers.

Nothing else in adaptdist invents node.meta keys. ``"val"`` is torch's own key
(a fake or real tensor, or a tuple of them, carrying shape and dtype).

Keys:
    ``adaptdist.role``: for placeholders, one of ``"param"``, ``"buffer"``, ``"batch"``.
    ``adaptdist.fqn``: for param/buffer placeholders, the module's qualified name.
    ``adaptdist.placements``: the layout of the node's output: a tuple of
        placements (one per mesh axis) or, for multi-output ops, a tuple of those.
    ``adaptdist.redistribute``: {arg index: target placements} for inputs whose
        producer layout differs from what this node needs (filled by propagation,
        consumed by the redistribution pass).
    ``adaptdist.collective``: marks nodes inserted by adaptdist (all_reduce, wait, slice).
    ``adaptdist.group``: on nodes with a collective mark, the process-group name of the mesh
        axis they belong to (``"adaptdist:<axis>"``). Every per-axis mark below is read through
        a getter that takes the group, so that lowering one mesh axis never touches what
        lowering another axis inserted.
    ``adaptdist.rank_slice``: on a slice node, the tensor dim whose bounds are each
        rank's own shard (set by redistribution, filled in by localization).
    ``adaptdist.gather_pad``: on a ``constant_pad_nd`` before an all_gather, the padded dim;
        localization pads each rank's shard to the largest shard's size.
    ``adaptdist.scatter_trim``: on a slice after a reduce_scatter, the dim whose padded block
        localization trims to the rank's own shard size.
    ``adaptdist.gather_chain``: on the last node of an all_gather sequence, the names of the
        sequence's nodes in order (so a pass can repeat the gather elsewhere).
    ``adaptdist.coalesced``: on the split after a bucketed all_gather, the names of the padded
        shards it carries, in order (localization sizes the split from their local shapes).
    ``adaptdist.vocab_bounds``: on nodes of a vocabulary-parallel lookup, ``(kind, table node
        name)`` where kind is ``"start"`` (the index shift), ``"rows"`` (the local row count) or
        ``"backward"`` (embedding_dense_backward: local rows and padding index); localization
        fills in this rank's values from the table's shard.
    ``adaptdist.resharded``: on a node whose input was redistributed, per redistribution
        ``(input name, from placement, to placement, group, collective)``: the plan's reshard points,
        which the consistency check compares with the collectives the programs issue.
    ``adaptdist.fallbacks``: on the output node, the nodes propagation ran whole under the
        replicate fallback (so its warning is given once per graph, not per propagation).
    ``adaptdist.strategies``: the node's candidate strategies along one mesh axis (a list of
        :class:`~adaptdist.strategy.Strategy`), from the list-strategies pass.
    ``adaptdist.rank_dim``: on nodes of a graph the torch.compile backend captured for all ranks
        at once, True where dim 0 of the value is the internal rank dim (error messages show the
        shape without it: one rank's shape).
    ``adaptdist.rank0_flag``: on a ``mul(x, 1.0)`` of the "local" BatchNorm's running statistics, the
        factor is 1 on coordinate 0 of the mesh axis and 0 elsewhere (localization fills it in), so the
        all_reduce after it gives every rank rank 0's value.
    ``adaptdist.output_roles``: on the output node, per output ``"buffer:<fqn>"``,
        ``"loss"`` or ``"grad:<fqn>"``; graphs of the torch.compile backend add per-rank outputs
        (:data:`PER_RANK_ROLES`): ``"out:<k>"`` (forward output k) and ``"grad_in:<k>"`` (gradient of
        batch input k), laid out like the batch inputs.
"""

from __future__ import annotations

from typing import Any

import torch.fx

from .placement import Placement

ROLE = "adaptdist.role"
FQN = "adaptdist.fqn"
PLACEMENTS = "adaptdist.placements"
REDISTRIBUTE = "adaptdist.redistribute"
COLLECTIVE = "adaptdist.collective"
RANK_SLICE = "adaptdist.rank_slice"
OUTPUT_ROLES = "adaptdist.output_roles"
GATHER_PAD = "adaptdist.gather_pad"
SCATTER_TRIM = "adaptdist.scatter_trim"
GATHER_CHAIN = "adaptdist.gather_chain"
COALESCED = "adaptdist.coalesced"
GROUP = "adaptdist.group"
STRATEGIES = "adaptdist.strategies"
VOCAB_BOUNDS = "adaptdist.vocab_bounds"
RESHARDED = "adaptdist.resharded"
FALLBACKS = "adaptdist.fallbacks"
PER_RANK_ROLES = ("out:", "grad_in:")
RANK_SLICE_ALIGN = "adaptdist.rank_slice_align"  # global RNG (passes/global_rng.py): the node a rank slice aligns with
GLOBAL_RNG = "adaptdist.global_rng"  # a random op that draws what one process draws (LoweringOptions.rng="global")
RANK_DIM = "adaptdist.rank_dim"
RANK0_FLAG = "adaptdist.rank0_flag"
GATHER_ROWS = "adaptdist.gather_rows"  # an embedding gradient built from gathered rows (passes/gather_embedding_rows.py)

# The random ops' batch location (:mod:`adaptdist.compiler.eager_batch` writes it, the global-rng pass reads it)
EAGER_BATCH = "adaptdist.eager_batch"
"""Node meta of a joint-graph random op: ``(dim, outer, rows)`` of one rank's shape
(:func:`adaptdist.compiler.eager_batch.annotate_eager_batch`), or ``None`` where the location is not known."""

EAGER_ORDER = "adaptdist.eager_order"
"""Node meta of a joint-graph random op: one rank's dims from outermost to innermost in memory, as the tensor it
fills is laid out in one rank's graph (``empty_like`` keeps a permuted layout; CPU's ``bernoulli_`` and
``uniform_`` fill in memory order), or the identity where that tensor is not dense."""


Layout = tuple[Placement, ...]


def val(node: torch.fx.Node) -> Any:
    """The fake/real value of ``node`` (tensor, tuple, or scalar)."""
    return node.meta.get("val")


def shape_str(node: Any) -> str:
    """A short description of a node's shape(s) for error messages (one rank's shape, ``... per rank``,
    for a value that carries the torch.compile backend's internal rank dim)."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    v = val(node)
    if isinstance(v, torch.Tensor) and has_rank_dim(node) and v.dim() > 0:
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape[1:])} per rank"
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(
            f"{list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x) for x in v
        ) + ")"
    return repr(v)


def mark_rank_dim(node: torch.fx.Node) -> None:
    """Record that dim 0 of ``node``'s value is the backend's internal rank dim."""
    node.meta[RANK_DIM] = True


def has_rank_dim(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(RANK_DIM, False))


def get_role(node: torch.fx.Node) -> str | None:
    return node.meta.get(ROLE)


def set_role(node: torch.fx.Node, role: str, fqn: str | None = None) -> None:
    assert role in ("param", "buffer", "batch"), role
    node.meta[ROLE] = role
    if fqn is not None:
        node.meta[FQN] = fqn


def get_fqn(node: torch.fx.Node) -> str | None:
    return node.meta.get(FQN)


def get_placements(node: torch.fx.Node) -> Any:
    return node.meta.get(PLACEMENTS)


def set_placements(node: torch.fx.Node, layout: Any) -> None:
    node.meta[PLACEMENTS] = layout


def get_redistribute(node: torch.fx.Node) -> dict[int, Layout]:
    return node.meta.get(REDISTRIBUTE, {})


def set_redistribute(node: torch.fx.Node, needs: dict[int, Layout]) -> None:
    if needs:
        node.meta[REDISTRIBUTE] = needs
    else:
        node.meta.pop(REDISTRIBUTE, None)


def mark_collective(node: torch.fx.Node, kind: str, group: str) -> None:
    """Mark ``node`` as inserted by adaptdist for a collective of mesh-axis group ``group``."""
    node.meta[COLLECTIVE] = kind
    node.meta[GROUP] = group


def get_collective(node: torch.fx.Node, group: str | None = None) -> str | None:
    """The collective mark of ``node`` (``None`` if unmarked or, with ``group``, marked for another group)."""
    if group is not None and node.meta.get(GROUP) != group:
        return None
    return node.meta.get(COLLECTIVE)


def get_group(node: torch.fx.Node) -> str | None:
    return node.meta.get(GROUP)


def _scoped(node: torch.fx.Node, key: str, group: str | None) -> Any:
    if group is not None and node.meta.get(GROUP) != group:
        return None
    return node.meta.get(key)


def set_rank_slice(node: torch.fx.Node, dim: int, group: str) -> None:
    """Mark a slice node whose bounds are each rank's shard of ``dim`` along the mesh axis of ``group``."""
    node.meta[RANK_SLICE] = dim
    node.meta[GROUP] = group


def get_rank_slice(node: torch.fx.Node, group: str | None = None) -> int | None:
    return _scoped(node, RANK_SLICE, group)


def set_rank_slice_align(node: torch.fx.Node, other: torch.fx.Node) -> None:
    """Make the rank slice ``node`` take the interval of ``other`` (sharded the same way), whatever consumes it."""
    node.meta[RANK_SLICE_ALIGN] = other.name


def get_rank_slice_align(node: torch.fx.Node, group: str | None = None) -> str | None:
    return _scoped(node, RANK_SLICE_ALIGN, group)


def mark_global_rng(node: torch.fx.Node) -> None:
    """Mark a random op that must draw the whole (replicated) tensor on every rank (passes/global_rng.py)."""
    node.meta[GLOBAL_RNG] = True


def is_global_rng(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(GLOBAL_RNG))


def mark_gather_rows(node: torch.fx.Node) -> None:
    """Mark an ``embedding_dense_backward`` whose batch-split gradient rows and indices are gathered, so every rank
    builds the whole (replicated) table gradient instead of all-reducing a partial one
    (passes/gather_embedding_rows.py)."""
    node.meta[GATHER_ROWS] = True


def gathers_rows(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(GATHER_ROWS))


def module_of(node: torch.fx.Node) -> str:
    """The innermost module path a node came from, for error messages ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls_name = getattr(cls, "__name__", str(cls)).split(".")[-1]
    return f"{path} ({cls_name})"


def source_of(node: torch.fx.Node) -> str:
    """Where in user code ``node`` came from, for error messages: "in module `layers.1` (Block) (model.py:57:
    `x = ...`)" ('' if unknown; from the capture, ``_torch_compat.SOURCE_META``)."""
    src = node.meta.get("adaptdist.source")
    if not src:
        return ""
    path, cls, file, line, code = src
    where = f" ({file.rsplit('/', 1)[-1]}:{line}: `{code}`)" if file else ""
    if path == "<loss>":  # _torch_compat.LOSS_PATH
        return "in the loss function" + where
    if path:
        return f"in module `{path}`" + (f" ({cls})" if cls else "") + where
    return (f"in the model's own forward ({cls})" if cls else "in the model's forward") + where


def where_of(node: torch.fx.Node) -> str:
    """`` in module `layers.1` (Block) (model.py:57: `x = ...`)``: where ``node`` came from, for an error naming it
    (:func:`source_of`, else :func:`module_of`; '' if unknown)."""
    where = source_of(node)
    if where:
        return " " + where
    mod = module_of(node)
    return f" in {mod}" if mod else ""


def set_output_roles(output_node: torch.fx.Node, roles: list[str]) -> None:
    assert output_node.op == "output" and len(roles) == len(output_node.args[0])
    output_node.meta[OUTPUT_ROLES] = list(roles)


def get_output_roles(output_node: torch.fx.Node) -> list[str]:
    return output_node.meta[OUTPUT_ROLES]


def set_gather_pad(node: torch.fx.Node, dim: int, group: str) -> None:
    node.meta[GATHER_PAD] = dim
    node.meta[GROUP] = group


def get_gather_pad(node: torch.fx.Node, group: str | None = None) -> int | None:
    return _scoped(node, GATHER_PAD, group)


def set_scatter_trim(node: torch.fx.Node, dim: int, size: int, group: str) -> None:
    """Mark a slice after a reduce_scatter: keep this rank's rows of ``dim`` (global size ``size``)."""
    node.meta[SCATTER_TRIM] = (dim, size)
    node.meta[GROUP] = group


def get_scatter_trim(node: torch.fx.Node, group: str | None = None) -> tuple[int, int] | None:
    return _scoped(node, SCATTER_TRIM, group)


def set_gather_chain(node: torch.fx.Node, chain: list[torch.fx.Node], group: str) -> None:
    node.meta[GATHER_CHAIN] = ([n.name for n in chain], group)


def get_gather_chain(node: torch.fx.Node, group: str | None = None) -> list[str] | None:
    got = node.meta.get(GATHER_CHAIN)
    if got is None or (group is not None and got[1] != group):
        return None
    return got[0]


def set_coalesced(node: torch.fx.Node, pads: list[torch.fx.Node], group: str) -> None:
    node.meta[COALESCED] = [p.name for p in pads]
    node.meta[GROUP] = group


def get_coalesced(node: torch.fx.Node, group: str | None = None) -> list[str] | None:
    return _scoped(node, COALESCED, group)


def set_strategies(node: torch.fx.Node, strategies: list) -> None:
    node.meta[STRATEGIES] = list(strategies)


def get_strategies(node: torch.fx.Node) -> list | None:
    return node.meta.get(STRATEGIES)


def set_vocab_bounds(node: torch.fx.Node, kind: str, table: torch.fx.Node, group: str) -> None:
    assert kind in ("start", "rows", "backward"), kind
    node.meta[VOCAB_BOUNDS] = (kind, table.name)
    node.meta[GROUP] = group


def get_vocab_bounds(node: torch.fx.Node, group: str | None = None) -> tuple[str, str] | None:
    return _scoped(node, VOCAB_BOUNDS, group)


def add_resharded(node: torch.fx.Node, src: str, frm: str, to: str, group: str, via: str) -> None:
    """Record that input ``src`` of ``node`` goes from placement ``frm`` to ``to`` on ``group`` by the
    collective ``via`` (``"local"`` for a slice)."""
    node.meta.setdefault(RESHARDED, []).append((src, frm, to, group, via))


def get_resharded(node: torch.fx.Node, group: str | None = None) -> list[tuple[str, str, str, str, str]]:
    return [r for r in node.meta.get(RESHARDED, []) if group is None or r[3] == group]


def set_fallbacks(output_node: torch.fx.Node, names: list[str]) -> None:
    output_node.meta[FALLBACKS] = list(names)


def get_fallbacks(output_node: torch.fx.Node) -> list[str] | None:
    return output_node.meta.get(FALLBACKS)


def set_rank0_flag(node: torch.fx.Node, group: str) -> None:
    node.meta[RANK0_FLAG] = True
    node.meta[GROUP] = group


def get_rank0_flag(node: torch.fx.Node, group: str | None = None) -> bool:
    return bool(_scoped(node, RANK0_FLAG, group))
