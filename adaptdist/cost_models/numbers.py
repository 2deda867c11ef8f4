"""Arithmetic that works on Python numbers and sympy expressions alike.

The cost models compute one formula for a concrete program (ints and floats) and for a
symbolic one (sympy expressions in batch size, sequence length and mesh-axis sizes); these
helpers pick the Python or the sympy operation so both paths share every formula.
"""

from __future__ import annotations

from typing import Any

import sympy


def is_symbolic(x: Any) -> bool:
    """Whether ``x`` is a sympy expression with free symbols."""
    return isinstance(x, sympy.Basic) and bool(x.free_symbols)


def smax(*xs: Any) -> Any:
    """max of numbers, or an unevaluated ``sympy.Max`` when any is symbolic (no pairwise comparison,
    which on large expressions is slow); numbers among symbolic arguments are folded into one."""
    if not any(is_symbolic(x) for x in xs):
        return max(_num(x) for x in xs)
    sym = list(dict.fromkeys(x for x in xs if is_symbolic(x)))
    nums = [_num(x) for x in xs if not is_symbolic(x)]
    if nums:
        sym.append(sympy.Float(max(nums)) if isinstance(max(nums), float) else sympy.Integer(max(nums)))
    return sym[0] if len(sym) == 1 else sympy.Max(*sym, evaluate=False)


def prune_dominated(exprs: list[Any]) -> list[Any]:
    """``exprs`` without those another one dominates term by term (for a sum of monomials in positive
    symbols, every coefficient at least as large means at least as large everywhere), so that a
    ``Max`` over them keeps the same value with fewer arguments. Expressions with a negative
    coefficient are kept as they are."""
    coeffs = [sympy.sympify(e).expand().as_coefficients_dict() for e in exprs]
    nonneg = [all(c >= 0 for c in d.values()) for d in coeffs]

    def dominates(a: dict, b: dict) -> bool:
        return all(a.get(m, 0) >= c for m, c in b.items())

    keep = []
    for i, (d, ok) in enumerate(zip(coeffs, nonneg)):
        if ok and any(j != i and nonneg[j] and dominates(coeffs[j], d) and (coeffs[j] != d or j < i)
                      for j in range(len(exprs))):
            continue
        keep.append(exprs[i])
    return keep


def smin(*xs: Any) -> Any:
    """min of numbers, or an unevaluated ``sympy.Min`` when any is symbolic."""
    if not any(is_symbolic(x) for x in xs):
        return min(_num(x) for x in xs)
    return sympy.Min(*xs, evaluate=False)


def ceil_log2(p: Any) -> Any:
    """``ceil(log2(p))`` for an int (0 for p <= 1) or a sympy expression."""
    if is_symbolic(p):
        return sympy.ceiling(sympy.log(p, 2))
    p = int(p)
    return 0 if p <= 1 else (p - 1).bit_length()


def sprod(xs: Any) -> Any:
    """Product of numbers or expressions (1 for none)."""
    out: Any = 1
    for x in xs:
        out = out * x
    return out


def _num(x: Any) -> Any:
    if isinstance(x, sympy.Basic):
        return int(x) if x.is_Integer else float(x)
    return x


def to_float(x: Any) -> float:
    """A concrete number as a float (raises TypeError for an expression with free symbols)."""
    if is_symbolic(x):
        raise TypeError(f"{x} has free symbols {sorted(map(str, x.free_symbols))}")
    return float(x)


__all__ = ["is_symbolic", "smax", "smin", "ceil_log2", "sprod", "to_float"]
