"""A Hugging Face ``transformers`` model's own tensor-parallel plan as adaptdist placements.

transformers models carry a plan: ``model._tp_plan`` (``{module path glob: style}``, ``*`` standing for a layer
number, e.g. ``{"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}``,
built from ``config.base_model_tp_plan``). ``--plan tp`` reads it where the model file defines no ``TP_PLAN``,
so a transformers model needs no globs of its own.

The styles map to storage placements as transformers' own ``transformers/distributed/tensor_parallel.py`` shards
(v5): column-wise styles shard a weight on dim ``ndim - 2`` (a Linear's output features) and its bias on dim 0;
row-wise styles shard a weight on dim ``ndim - 1`` (input features) and keep the bias whole; embedding styles
shard the table on dim 0 (``embedding_rowwise``, the vocabulary) or 1. Styles that keep parameters whole
(``replicate``, ``sequence_parallel``, ...) or that have no single-placement reading (``mla_kv_a_proj``,
``moe_tp_experts``, ``local_params``) are left to the plan's default (replicated). adaptdist runs the model's
global semantics whatever the placements, so a style read differently here costs communication, never numbers.
"""

from __future__ import annotations

import re

import torch.nn as nn

COLWISE_STYLES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "unit_colwise", "packed_colwise",
                            "local_colwise"})
ROWWISE_STYLES = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "unit_rowwise", "packed_rowwise",
                            "local_rowwise"})
EMBEDDING_DIMS = {"embedding_rowwise": 0, "embedding_colwise": 1}


def _style_dim(style: str, leaf: str, ndim: int) -> int | None:
    """The dim ``style`` shards a parameter named ``leaf`` with ``ndim`` dims on, or None (kept whole)."""
    if style in EMBEDDING_DIMS:
        return EMBEDDING_DIMS[style] if leaf == "weight" and ndim == 2 else None
    if style in COLWISE_STYLES:
        return 0 if ndim == 1 else ndim - 2
    if style in ROWWISE_STYLES:
        return None if ndim == 1 else ndim - 1  # a row-parallel bias is added after the sum: whole
    return None


def _pattern(key: str) -> re.Pattern:
    """A plan key as a regex over module/parameter paths: ``*`` is one path component (a layer index)."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*")))


def _plans(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """(path prefix, module, its plan) for each outermost submodule that carries a transformers plan."""
    found: list[tuple[str, nn.Module, dict]] = []
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if not isinstance(plan, dict) or not plan or not hasattr(module, "config"):
            continue
        if any(p == "" or prefix.startswith(p + ".") for p, _, _ in found):
            continue  # the base model inside a ForCausalLM: its plan is in the outer one's, prefixed
        found.append((prefix, module, plan))
    return found


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """``{parameter fqn: "S(dim)"}`` from the transformers plans of ``model`` and its submodules (a wrapper around
    a ``LlamaForCausalLM`` too); ``{}`` where none carries a plan (GPT-2 has none, for one).

    Keys name exact parameters, in ``model.named_parameters()`` order; a parameter several plan keys match takes
    the first key's style, as transformers applies them.
    """
    out: dict[str, str] = {}
    for prefix, module, plan in _plans(model):
        rules = [(_pattern(k), str(style)) for k, style in plan.items()]
        for name, p in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            for rx, style in rules:
                if rx.fullmatch(owner):  # a module's style: its weight and bias
                    dim = _style_dim(style, leaf, p.dim())
                elif rx.fullmatch(name):  # a parameter named itself (packed experts' [E, 2I, D])
                    dim = _style_dim(style, "weight", p.dim())
                else:
                    continue
                if dim is not None:
                    out[f"{prefix}.{name}" if prefix else name] = f"S({dim})"
                break
    return out
