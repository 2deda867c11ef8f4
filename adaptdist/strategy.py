"""A sharding strategy of one op along one mesh axis: input placements -> output placements.

On an N-D mesh a node's strategy is one such choice per axis (DTensor expands its
single-mesh-dim strategies the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from .placement import Placement, parse_placement


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's tensor inputs (in argument order, lists flattened) and outputs.

    ``None`` marks an output the op does not produce (masked-off backward outputs).
    ``source`` says where the strategy comes from: ``"dtensor"`` (torch's registered
    strategy for the op) or ``"adaptdist"`` (our rule, where torch has none or refuses
    the argument form).
    """

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement | None, ...]
    source: str

    def __post_init__(self) -> None:
        if self.source not in ("dtensor", "adaptdist"):
            raise ValueError(f"strategy source must be dtensor or adaptdist, got {self.source!r}")

    def __repr__(self) -> str:
        ins = ", ".join(repr(p) for p in self.inputs)
        outs = ", ".join(repr(p) for p in self.outputs)
        return f"({ins}) -> ({outs}) [{self.source}]"

    def text(self) -> str:
        """``"S(0),R->S(0)"``: inputs, then outputs (``-`` for None); :meth:`parse` reads it back."""
        def part(ps):
            return ",".join("-" if p is None else repr(p) for p in ps)
        return f"{part(self.inputs)}->{part(self.outputs)}"

    @staticmethod
    def parse(text: str, source: str = "adaptdist") -> "Strategy":
        """The inverse of :meth:`text`.

        Raises:
            ValueError: not ``INPUTS->OUTPUTS`` of placements (from :func:`parse_placement`).
        """
        ins, arrow, outs = text.partition("->")
        if not arrow:
            raise ValueError(f"strategy {text!r} is not INPUTS->OUTPUTS, e.g. S(0),R->S(0)")

        def part(t):
            return tuple(None if x == "-" else parse_placement(x) for x in t.split(",")) if t else ()
        return Strategy(part(ins), part(outs), source)
