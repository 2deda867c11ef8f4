"""A rank program as the cost models see it: its node order, tensors, storages and collectives.

:func:`build_schedule` runs the rank's GraphModule once on fake tensors (no memory, no
compute) and records, in the program's node order:

- every node's kind: ``input`` (placeholder), ``constant`` (get_attr), ``compute`` (creates
  a storage), ``view`` (only aliases existing storages: ``t``, ``view``, ``getitem``...),
  ``collective`` (a ``_c10d_functional`` op), ``wait`` (``wait_tensor``), ``output``;
- every output tensor's shape, dtype and storage;
- every storage's size, the node that creates it and the last node that uses it or any of
  its views (placeholders and program outputs stay live to the end of the step, index
  ``len(nodes)``: the caller holds them).

Storage identity comes from the fake run (views share their base's storage, as at run
time), except ``wait_tensor``, which at run time returns its input
(``torch/csrc/distributed/c10d/Functional.cpp``) and under fake tensors a copy: its output, and
every later view of it (a gradient bucket's ``split_with_sizes``), gets the collective's storage.

A schedule's integers (every dim of every tensor, every storage's bytes) can be replaced
all at once (:meth:`StepSchedule.numbers` / :meth:`StepSchedule.with_numbers`); that is how
:mod:`.symbolic` turns a concrete schedule into one in sympy expressions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from .. import _torch_compat as compat
from .._torch_compat import tree_flatten, tree_map
from ..errors import UnsupportedOpError
from .communication import functional_collective_kind
from .numbers import sprod


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: ``shape`` (ints or sympy), dtype name (``"float32"``), bytes per element, and the
    index of its storage in :attr:`StepSchedule.storages`."""

    shape: tuple
    dtype: str
    itemsize: int
    storage: int

    @property
    def numel(self) -> Any:
        return sprod(self.shape)

    @property
    def nbytes(self) -> Any:
        """Bytes of this tensor's elements (a view's own elements, not its whole storage)."""
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Ref:
    """A tensor argument: output ``index`` of node ``node`` (``index`` None: a multi-output node as a whole)."""

    node: int
    index: int | None


@dataclass(frozen=True)
class StepNode:
    """One node of the program, in program order (see the module docstring for ``kind``).

    ``args``/``kwargs`` are the node's arguments with every node replaced by a :class:`Ref`;
    ``outputs`` are the tensors among its output's leaves (None for non-tensor leaves);
    ``collective`` and ``group`` name a collective's kind and process group; ``waits_on`` is the
    index of the collective a ``wait`` node waits for; ``role`` is an input's
    ``param:<fqn>``, ``buffer:<fqn>`` or ``batch:<i>``.
    """

    index: int
    name: str
    kind: str
    target: Any
    args: Any
    kwargs: Any
    outputs: tuple[TensorSpec | None, ...]
    multi_output: bool = False
    role: str = ""
    collective: str | None = None
    group: str | None = None
    waits_on: int | None = None

    def tensor_outputs(self) -> list[TensorSpec]:
        return [t for t in self.outputs if t is not None]

    def refs(self) -> list[Ref]:
        """The tensor arguments, in order, each once."""
        leaves, _ = tree_flatten((self.args, self.kwargs))
        return list(dict.fromkeys(x for x in leaves if isinstance(x, Ref)))


@dataclass(frozen=True)
class StorageSpec:
    """A storage: its bytes, the node that creates it, the last node that needs it (``len(nodes)``: live
    after the program returns), and whose it is: ``param``, ``buffer``, ``batch``, ``constant``,
    ``grad`` (holds a gradient output), ``output`` (another output) or ``activation``."""

    nbytes: Any
    created: int
    last_use: int
    owner: str


@dataclass(frozen=True)
class StepSchedule:
    """One rank's program as nodes and storages (see the module docstring).

    Attributes:
        nodes: in program order. storages: by index (:attr:`TensorSpec.storage`).
        rank: the rank. mesh: mesh axis -> size of the program's mesh.
        param_storages: storage index of each trainable parameter, in the optimizer's order.
        output_roles: the program's output roles.
    """

    nodes: tuple[StepNode, ...]
    storages: tuple[StorageSpec, ...]
    rank: int
    mesh: dict
    param_storages: tuple[int, ...]
    output_roles: tuple[str, ...] = ()

    @property
    def end(self) -> int:
        """The index standing for "after the program returned"."""
        return len(self.nodes)

    def spec(self, ref: Ref) -> TensorSpec | tuple[TensorSpec | None, ...]:
        node = self.nodes[ref.node]
        return node.outputs if ref.index is None else node.outputs[ref.index]

    def numbers(self) -> list[Any]:
        """Every dim of every output tensor, then every storage's bytes, in a fixed order."""
        out: list[Any] = []
        for n in self.nodes:
            for t in n.outputs:
                if t is not None:
                    out.extend(t.shape)
        out.extend(s.nbytes for s in self.storages)
        return out

    def number_labels(self) -> list[str]:
        """What each of :meth:`numbers` is, e.g. ``"addmm: dim 0"``, ``"storage of addmm"`` (for messages)."""
        out: list[str] = []
        for n in self.nodes:
            for k, t in enumerate(n.outputs):
                if t is not None:
                    out.extend(f"{n.name}{f'[{k}]' if n.multi_output else ''}: dim {d}" for d in range(len(t.shape)))
        creators = {}
        for n in self.nodes:
            for t in n.outputs:
                if t is not None:
                    creators.setdefault(t.storage, n.name)
        out.extend(f"storage of {creators.get(k, '?')}" for k in range(len(self.storages)))
        return out

    def with_numbers(self, numbers: Sequence[Any]) -> "StepSchedule":
        """A copy whose integers are ``numbers`` (same order as :meth:`numbers`)."""
        it: Iterator[Any] = iter(numbers)
        nodes = []
        for n in self.nodes:
            outs = tuple(None if t is None else replace(t, shape=tuple(next(it) for _ in t.shape)) for t in n.outputs)
            nodes.append(replace(n, outputs=outs))
        storages = tuple(replace(s, nbytes=next(it)) for s in self.storages)
        rest = list(it)
        assert not rest, f"{len(rest)} numbers left over"
        return replace(self, nodes=tuple(nodes), storages=storages)

    def structure(self) -> tuple:
        """What must agree between two schedules for their numbers to correspond: node names, kinds,
        targets, output counts, storages' creators, last uses and owners."""
        return (tuple((n.name, n.kind, str(n.target), tuple(None if t is None else (len(t.shape), t.dtype, t.storage)
                                                           for t in n.outputs)) for n in self.nodes),
                tuple((s.created, s.last_use, s.owner) for s in self.storages))


class _Recorder(torch.fx.Interpreter):
    """Runs a graph (on fake tensors) and keeps every node's output alive, so storage ids stay unique."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        v = super().run_node(n)
        self.values[n] = v
        return v


def build_schedule(program: Any) -> StepSchedule:
    """The schedule of a :class:`~adaptdist.program.RankProgram` (its ``graph_module``, inputs and outputs).

    Raises:
        UnsupportedOpError: the program cannot run on fake tensors (names the node).
    """
    params = set(program.param_fqns)
    roles = [("param:" if f in params else "buffer:") + f for f in program.input_fqns]
    roles += [f"batch:{i}" for i in range(program.num_batch_inputs)]
    return schedule_from_graph(program.graph_module, roles, list(program.output_roles), program.rank,
                               dict(program.mesh), list(program.param_fqns))


def schedule_from_graph(gm: torch.fx.GraphModule, input_roles: Sequence[str], output_roles: Sequence[str],
                        rank: int = 0, mesh: dict | None = None, param_fqns: Sequence[str] = ()) -> StepSchedule:
    """The schedule of ``gm``, whose placeholders have ``input_roles`` (``param:<fqn>``, ``buffer:<fqn>``,
    ``batch:<i>``) and whose outputs have ``output_roles`` (``grad:<fqn>``, ``loss``, ...).

    Placeholders need ``meta["val"]`` (a tensor giving shape, stride and dtype).

    Raises:
        UnsupportedOpError: a placeholder without a tensor value, or a node that fails on fake tensors.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(input_roles):
        raise UnsupportedOpError(f"the graph has {len(placeholders)} inputs but {len(input_roles)} input roles")
    mode = compat.fake_tensor_mode(allow_constants=True)
    inputs = []
    with mode:
        for ph in placeholders:
            v = ph.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise UnsupportedOpError(f"input {ph.name} has no tensor value in meta['val']; the cost model needs "
                                         "its shape and dtype")
            # on the value's device: the graph's own device arguments (an arange's, an _assert_tensor_metadata's)
            # name the device it was captured on, cuda for a cuda job
            inputs.append(torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device))
    rec = _Recorder(gm)
    try:
        with mode:
            rec.run(*inputs)
    except Exception as e:  # noqa: BLE001 - reported with the node it failed on
        bad = next((n for n in gm.graph.nodes if n not in rec.values), None)
        raise UnsupportedOpError(
            f"costing needs the program to run on fake tensors, but node {bad.name if bad else '?'} "
            f"({bad.target if bad else '?'}) failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    return _assemble(gm, rec.values, list(input_roles), list(output_roles), rank, dict(mesh or {}), list(param_fqns))


def _assemble(gm, values, input_roles, output_roles, rank, mesh, param_fqns) -> StepSchedule:
    graph_nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(graph_nodes)}
    storage_ids: dict[int, int] = {}
    storages: list[dict] = []
    nodes: list[StepNode] = []
    role_of = {ph: r for ph, r in zip(gm.graph.find_nodes(op="placeholder"), input_roles)}

    def to_ref(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = values.get(a)
            return Ref(index[a], 0 if isinstance(v, torch.Tensor) else None)
        return a

    for i, n in enumerate(graph_nodes):
        v = values.get(n)
        coll = functional_collective_kind(n.target) if n.op == "call_function" else None
        leaves = [v] if isinstance(v, torch.Tensor) else tree_flatten(v)[0] if isinstance(v, (tuple, list)) else []
        outs: list[TensorSpec | None] = []
        created = False
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                outs.append(None)
                continue
            if coll == "wait":
                sid = _wait_source_storage(n, nodes, index)
                # later views of the waited tensor (split_with_sizes of a gradient bucket, a view of an
                # all_gather's output) alias the collective's storage at run time, not a new one
                storage_ids.setdefault(compat.storage_key(leaf), sid)
            else:
                key = compat.storage_key(leaf)
                sid = storage_ids.get(key)
                if sid is None:
                    sid = storage_ids[key] = len(storages)
                    storages.append({"nbytes": int(leaf.untyped_storage().nbytes()), "created": i, "last": i,
                                     "owner": "activation"})
                    created = True
            outs.append(TensorSpec(tuple(int(d) for d in leaf.shape), str(leaf.dtype).removeprefix("torch."),
                                   leaf.element_size(), sid))
        role = role_of.get(n, "")
        if n.op == "placeholder":
            kind = "input"
        elif n.op == "get_attr":
            kind = "constant"
        elif n.op == "output":
            kind = "output"
        elif coll == "wait":
            kind = "wait"
        elif coll is not None:
            kind = "collective"
        else:
            kind = "compute" if created else "view"
        waits_on = None
        if kind == "wait":
            waits_on = _collective_of(n.args[0], index, graph_nodes)
        group = str(n.args[-1]) if kind == "collective" else None
        nodes.append(StepNode(i, n.name, kind, n.target, tree_map(to_ref, n.args), tree_map(to_ref, n.kwargs),
                              tuple(outs), not isinstance(v, torch.Tensor) and bool(leaves), role, coll if kind ==
                              "collective" else None, group, waits_on))
        for t in outs:
            if t is not None and kind in ("input", "constant"):
                st = storages[t.storage]
                kind_of_input = role.split(":")[0]
                st["owner"] = kind_of_input if kind_of_input in ("param", "buffer", "batch") else "constant"
        # a node extends the life of every storage it reads (through any view of it)
        for ref in nodes[-1].refs():
            src = nodes[ref.node]
            specs = src.outputs if ref.index is None else (src.outputs[ref.index],)
            for t in specs:
                if t is not None:
                    storages[t.storage]["last"] = max(storages[t.storage]["last"], i)
    end = len(nodes)
    out_node = nodes[-1]
    flat_out, _ = tree_flatten(out_node.args[0] if out_node.kind == "output" else ())
    for k, a in enumerate(flat_out):
        if isinstance(a, Ref):
            t = nodes[a.node].outputs[a.index or 0]
            if t is None:
                continue
            st = storages[t.storage]
            st["last"] = end
            role = output_roles[k] if k < len(output_roles) else "output"
            if st["owner"] == "activation" or (st["owner"] == "output" and role.startswith("grad:")):
                st["owner"] = "grad" if role.startswith("grad:") else "output"
    for st in storages:
        if st["owner"] in ("param", "buffer", "batch", "constant"):
            st["created"], st["last"] = 0, end
    param_storage = {}
    for n in nodes:
        if n.role.startswith("param:") and n.outputs and n.outputs[0] is not None:
            param_storage[n.role[len("param:"):]] = n.outputs[0].storage
    return StepSchedule(
        tuple(nodes), tuple(StorageSpec(s["nbytes"], s["created"], s["last"], s["owner"]) for s in storages),
        rank, mesh, tuple(param_storage[f] for f in param_fqns if f in param_storage), tuple(output_roles),
    )


def _collective_of(a: Any, index: dict, graph_nodes: list) -> int | None:
    """The collective node a wait's argument comes from (through getitem of coalesced outputs)."""
    while isinstance(a, torch.fx.Node):
        if functional_collective_kind(a.target) not in (None, "wait"):
            return index[a]
        a = a.args[0] if a.args else None
    return None


def _wait_source_storage(n: torch.fx.Node, nodes: list[StepNode], index: dict) -> int:
    a = n.args[0]
    src = nodes[index[a]]
    t = src.outputs[0]
    assert t is not None, f"wait_tensor {n.name} waits on a non-tensor"
    return t.storage
