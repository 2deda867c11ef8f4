"""Manual plans: placements users give on parameters by name (globs), as Megatron or Paddle's
``shard_tensor`` would, e.g. ``{"blocks.*.fc.weight": Shard(0), "blocks.*.fc_out.weight": Shard(1)}``."""

from __future__ import annotations

import fnmatch
from typing import Mapping

from .errors import UsageError
from .placement import Placement, Replicate, Shard, parse_placement


def resolve_param_placements(shapes: Mapping[str, tuple[int, ...]], annotations: Mapping[str, Placement | str]
                             ) -> dict[str, Placement]:
    """Map each parameter/buffer name to the placement of the first glob matching it.

    Args:
        shapes: fqn -> global shape of every parameter and buffer.
        annotations: glob -> placement (a Placement or its text, e.g. ``"S(0)"``); order matters.

    Raises:
        UsageError: a glob matches no parameter, a placement does not parse, or it shards a
            dim the parameter does not have; names the glob and parameter.
    """
    out: dict[str, Placement] = {}
    for glob, pl in annotations.items():
        try:
            placement = parse_placement(pl) if isinstance(pl, str) else pl
        except ValueError as e:
            raise UsageError(f"annotation {glob!r}: {e}") from None
        hits = [f for f in shapes if fnmatch.fnmatchcase(f, glob)]
        if not hits:
            close = sorted(shapes)[:6]
            raise UsageError(f"annotation {glob!r} matches no parameter; names look like {close}")
        for f in hits:
            if isinstance(placement, Shard) and placement.dim >= len(shapes[f]):
                raise UsageError(
                    f"annotation {glob!r} shards dim {placement.dim} of {f!r}, which has shape {list(shapes[f])}"
                )
            out.setdefault(f, placement)
    return {f: p for f, p in out.items() if not isinstance(p, Replicate)}
