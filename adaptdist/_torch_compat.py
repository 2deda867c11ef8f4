"""The one place adaptdist touches torch's private APIs.

A torch upgrade that moves one of these should break this file only.
Checked against torch 2.13.0 (every name: ``benchmarks/device_check_compat.py`` resolves the 66 private names this
file reaches, 0 missing).

torch 2.11 (the GPU machine of ``benchmarks/device_check.sh``), for the names on the paths that script runs
(``adaptdist train --plan dp`` on one rank, ``--mode async-hetero``, the torch.compile backend): run on PyPI's
torch 2.11.0 (the CUDA build, on a CPU-only machine; Python 3.12) on 2026-12-04: device_check_compat.py 0 missing,
the script's CPU dry run 0 failed steps, and the fast tests of devices, capture, the Dynamo backend, dlrm and
async-hetero (notes/issue17_verification.md). What differs there:

- ``torch.compiler._compile_session_context`` (:func:`compile_session`, every capture): added in pytorch#184614
  (May 2026), after 2.11: absent there. Fallback: set ``torch.compiler._is_compiling_flag``, what it sets.
- DTensor's single-mesh-dim strategies (:func:`dtensor_strategies`: ``_ops.single_dim_strategy._ShardingPlaceholder``,
  ``ShardingPropagator.op_single_dim_strategy_funcs``): infrastructure from pytorch#170359 (Dec 2025), its op
  registrations through 2026; the registry is read with ``getattr`` and a missing placeholder class is stood in
  for, so a torch without them uses the full strategy functions. ``DeviceMesh(..., _rank=)``: pytorch#162439
  (Sep 2025), in 2.11; a ``TypeError`` falls back to the call without it.
- ``OpSpec`` (renamed from ``PlacementStrategy`` in 2.7), ``aot_export_module``, ``FakeTensorMode``, ``make_fx``,
  ``flop_counter.flop_registry``/``shape_wrapper``, ``_c10d_functional.*``, ``_register_process_group``,
  ``_get_default_store``, ``redistribute_cost``, ``utils._pytree``, ``CapturedTraceback``: older than 2.9, unchanged
  in name.
- The elastic agent's shutdown grace (``LaunchConfig.shutdown_timeout``, torchrun's ``--shutdown-timeout``):
  absent in 2.11 (a fixed 30 s there); :func:`elastic_launch_config` and :func:`torchrun_shutdown_timeout_args`
  leave it out.
- The backend's eager-call guard and Dynamo hooks (``set_code_exec_strategy``, ``FrameExecStrategy``,
  ``innermost_backend``, ``_is_in_optimized_module``, ``_autocast_supported_devices``): resolve on 2.11, and
  tests/test_dynamo_backend.py's one-process tests pass there.
- The capture's record of each node's user source (:func:`aot_export_joint`'s ``source_root``: aot's
  ``graph_capture.make_fx`` and ``_aot_export_function``, ``fx.traceback.preserve_node_meta``; added 2026-12-04):
  not run on 2.11; a missing name records nothing (errors then name only the node). Its innermost user frame
  (an op in a helper function, a method not named forward, the loss function) comes through
  ``fx.proxy.TracerBase._filter_traceback_frames`` (a torch without it: the forward's line that called the
  helper, no line for the loss, as torch records).
- The capture of a model with an RNN (:func:`aot_export_joint`; added 2026-12-04): ``torch.backends.mkldnn.enabled``
  (public) set False around the export (``torch._decomp``'s LSTM decomposition reads it), and aot's ``create_graph_signature`` (in
  ``torch._functorch.aot_autograd``'s namespace, looked up with ``getattr``: absent, nothing is wrapped) wrapped
  to give repeated gradient outputs their own node. Not run on 2.11.
- DTensor on 2.11 registers 4 single-mesh-dim strategies (2.13: 1,013); the rest come from the full strategy
  functions (584): the ILP's candidate strategies may differ (``--plan auto`` only; not on the script's paths).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import re
import sys
import traceback
from typing import Any, Callable

import torch
import torch.fx
# torch's pytree helpers are private (torch.utils._pytree); everything else reaches them through here
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401 -- re-exported
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _get_eval_frame_callback

from .kernels import load as _load_kernels

# Every adaptdist module that uses torch comes through here: register torch.ops.adaptdist.* (warns once and
# falls back to gloo when the C++ kernels are missing; never raises).
_load_kernels()


def aot_export_joint(module: torch.nn.Module, args: tuple, loss_index: int = 0,
                     source_root: torch.nn.Module | None = None):
    """Export ``module(*args)`` and its backward as one functional ATen graph.

    Returns ``(GraphModule, GraphSignature)``; the signature lists parameters,
    buffers, user inputs, buffer mutations, the loss output and which output is
    which parameter's gradient. Source: ``torch._functorch.aot_autograd.aot_export_module``.

    Node stack traces are recorded by ``_fast_fx_stack_traces`` (same text, a fraction of the cost). Each node
    records where in user code it came from under :data:`SOURCE_META` when ``source_root`` is given (the
    user's model, whose submodules' paths it names).
    """
    from torch._functorch.aot_autograd import aot_export_module

    sources = _first_trace_sources(source_root) if source_root is not None else contextlib.nullcontext([])
    rnn = _unfused_rnns(module, source_root)
    with _fast_fx_stack_traces(), _distinct_joint_outputs(), rnn, sources as first:
        gm, sig = aot_export_module(module, args, trace_joint=True, output_loss_index=loss_index)
    _copy_sources(gm, first)
    return gm, sig


def _unfused_rnns(*modules: torch.nn.Module | None) -> Any:
    """Context manager: where one of ``modules`` holds an ``nn.RNNBase`` (nn.RNN, nn.GRU, nn.LSTM), the capture
    runs with ``torch.backends.mkldnn.enabled`` False, so that every ``aten.lstm`` decomposes into its cells' ATen
    ops (mm, addmm, sigmoid, tanh, ...), which the planner has sharding rules for.

    Under aot's tracing ``aten.lstm`` runs torch's Python decomposition (``torch._decomp.decompositions.lstm_impl``);
    its ``select_one_layer_lstm_function`` picks oneDNN's fused layer (``aten.mkldnn_rnn_layer`` and, for the
    backward, ``mkldnn_rnn_layer_backward``) for a CPU float layer without projections whose *input* does not
    require grad (meant for inference, but a first layer fed the batch qualifies while its weights train): the
    planner has no rule for that op, and its backward returns one tensor as the gradient of both biases (see
    :func:`_distinct_joint_outputs`). On CUDA it never picks oneDNN; GRU and RNN have no fused path there.
    Elsewhere: nothing changes."""
    if not any(isinstance(m, torch.nn.RNNBase) for root in modules if root is not None for m in root.modules()):
        return contextlib.nullcontext()
    return _mkldnn_off()


@contextlib.contextmanager
def _mkldnn_off():
    """Within: ``torch.backends.mkldnn.enabled`` is False (only that flag: ``torch.backends.mkldnn.flags()`` also
    resets TF32 and determinism, and warns on CPU builds)."""
    prior = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = False
        yield
    finally:
        torch.backends.mkldnn.enabled = prior


@contextlib.contextmanager
def _distinct_joint_outputs():
    """Within: before aot_export_module builds the joint graph's signature, every output node that the graph
    returns more than once is returned, the second time on, as a fresh ``aten.clone`` of it
    (:func:`_clone_repeated_outputs`).

    aot's ``create_graph_signature`` (``torch._functorch._aot_autograd.input_output_analysis``) maps gradients to
    parameters in a dict keyed by the gradient output's node name, so two parameters whose gradients are the same
    node (nn.LSTM's ``bias_ih_l*`` and ``bias_hh_l*``: the gates add both biases, so ATen's LSTM backward returns
    one tensor for both) collapse into one entry and aot_export_module fails with ``len(gradients_to_parameters)=5
    + len(gradients_to_user_inputs)=0 != len(backward_output_names)=6``. A torch without that name: nothing
    changes."""
    import torch._functorch.aot_autograd as aot_autograd

    real = getattr(aot_autograd, "create_graph_signature", None)
    if real is None:
        yield
        return

    def create_graph_signature(fx_g: Any, *a: Any, **k: Any) -> Any:
        if isinstance(fx_g, torch.fx.GraphModule):
            _clone_repeated_outputs(fx_g)
        return real(fx_g, *a, **k)

    aot_autograd.create_graph_signature = create_graph_signature
    try:
        yield
    finally:
        aot_autograd.create_graph_signature = real


def _clone_repeated_outputs(gm: torch.fx.GraphModule) -> int:
    """Make each output of ``gm`` a distinct node: the second and later occurrences of a node among the outputs
    become ``aten.clone.default`` of it (its meta copied: ``val``, stack trace). Returns how many were cloned."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None or not isinstance(out.args[0], (tuple, list)):
        return 0
    seen: set[torch.fx.Node] = set()
    values = list(out.args[0])
    cloned = 0
    for i, v in enumerate(values):
        if not isinstance(v, torch.fx.Node):
            continue
        if v in seen:
            with gm.graph.inserting_before(out):
                c = gm.graph.call_function(torch.ops.aten.clone.default, (v,))
            c.meta = dict(v.meta)
            values[i] = c
            cloned += 1
        seen.add(v)
    if cloned:
        out.args = (type(out.args[0])(values),) + tuple(out.args[1:])
        gm.recompile()
    return cloned


# node.meta key: where in user code a node of a captured joint graph came from, ``(module path, module class name,
# file, line, code)`` (module path '' for the root's own forward, LOSS_PATH outside it; file '' when unknown); see
# :func:`aot_export_joint`
SOURCE_META = "adaptdist.source"
LOSS_PATH = "<loss>"
_RETRACED_LINE = re.compile(r"^\s*(\w+) = ")


@contextlib.contextmanager
def _first_trace_sources(root: torch.nn.Module):
    """Within: aot_export_module's first trace (``make_fx`` of the joint forward+backward, in
    ``torch._functorch._aot_autograd.graph_capture``) records each node's user stack trace and module stack (under
    ``fx_traceback.preserve_node_meta``, the modules pushed by forward hooks; backward nodes get their forward
    node's module through ``seq_nr``, as aot copies it). Its graph is appended to the yielded list. aot then
    re-traces that graph by calling it, which loses both (the re-trace's stack traces point into its generated
    code, one line per first-trace node); :func:`_copy_sources` maps them back. A torch without these names:
    nothing is recorded.

    make_fx's tracer keeps only the frames named ``forward`` of a node's stack trace
    (``TracerBase._filter_traceback_frames`` under ``_record_forward_stack_traces_only``), so an op in a helper
    function, a method not named forward or the loss function would name only the line that called it (or, for
    the loss, no line). Within the first trace the filter also keeps the innermost frame of the user's code
    (:func:`_innermost_user_frame`), so that frame is the one :func:`_user_frame` finds."""
    import torch._functorch.aot_autograd as aot_autograd
    import torch.fx.proxy as fx_proxy
    import torch.fx.traceback as fx_traceback

    first: list[torch.fx.GraphModule] = []
    try:
        import torch._functorch._aot_autograd.graph_capture as graph_capture
    except ImportError:
        graph_capture = None
    real_export = getattr(aot_autograd, "_aot_export_function", None)
    real_make_fx = getattr(graph_capture, "make_fx", None)
    if real_export is None or real_make_fx is None or not hasattr(fx_traceback, "has_preserved_node_meta"):
        yield first
        return
    paths: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    stack: list[tuple[str, tuple[str, type]]] = []

    def push(mod: torch.nn.Module, args: Any) -> None:
        path = paths.get(id(mod))
        if path is not None and fx_traceback.has_preserved_node_meta():
            stack.append((path, (path, type(mod))))
            fx_traceback.current_meta["nn_module_stack"] = dict(stack)

    def pop(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if stack and stack[-1][0] == paths.get(id(mod)):
            stack.pop()
            if stack:
                fx_traceback.current_meta["nn_module_stack"] = dict(stack)
            else:
                fx_traceback.current_meta.pop("nn_module_stack", None)

    tracer_base = getattr(fx_proxy, "TracerBase", None)
    real_filter = getattr(tracer_base, "_filter_traceback_frames", None)

    def keep_user_frame(self: Any, summary: traceback.StackSummary) -> traceback.StackSummary:
        kept = real_filter(self, summary)
        user = _innermost_user_frame(summary)
        if user is None or any(f is user for f in kept):
            return kept
        ids = {id(f) for f in kept}
        return traceback.StackSummary.from_list([f for f in summary if f is user or id(f) in ids])

    def make_fx(*a: Any, **k: Any) -> Callable:
        k.setdefault("record_stack_traces", True)
        trace = real_make_fx(*a, **k)

        def traced(*args: Any) -> Any:
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
            with fx_traceback.preserve_node_meta():
                hooks = [register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)]
                if real_filter is not None:
                    tracer_base._filter_traceback_frames = keep_user_frame
                try:
                    return trace(*args)
                finally:
                    if real_filter is not None:
                        tracer_base._filter_traceback_frames = real_filter
                    for h in hooks:
                        h.remove()
                    stack.clear()
        return traced

    def export(*a: Any, **k: Any) -> Any:
        out = real_export(*a, **k)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.fx.GraphModule):
            first.append(out[0])
        return out

    graph_capture.make_fx, aot_autograd._aot_export_function = make_fx, export
    try:
        yield first
    finally:
        graph_capture.make_fx, aot_autograd._aot_export_function = real_make_fx, real_export


def _user_frame(stack_trace: str | None) -> tuple[str, int, str] | None:
    """The innermost frame of a recorded stack trace in the user's code (:func:`_code_kind`): (file, line, code)
    (for a torch module, the line that called it)."""
    frames = [f for f in _traceback_frames(stack_trace or "") if _code_kind(f[0]) == "user"]
    return frames[-1] if frames else None


_ADAPTDIST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STEP_CODE = (os.path.join(_ADAPTDIST_DIR, "compiler") + os.sep, os.path.abspath(__file__))
_LIBRARY_CODE = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(os.__file__)) + os.sep)  # torch, Python's standard library
_code_kinds: dict[str, str] = {}


def _code_kind(filename: str) -> str:
    """Whose code ``filename`` is: "step" (adaptdist's compiler, which calls the model and the loss function, and
    this file), "library" (torch, Python's standard library, the rest of adaptdist but its built-in models,
    generated code such as ``<eval_with_key>.3``) or "user" (the model's and the loss's files, wherever they
    are: a script, a package such as transformers, adaptdist/models)."""
    kind = _code_kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_STEP_CODE[0]) or path == _STEP_CODE[1]:
            kind = "step"
        elif path.startswith("<") or (path.startswith(_ADAPTDIST_DIR)
                                      and not path.startswith(os.path.join(_ADAPTDIST_DIR, "models") + os.sep)):
            kind = "library"
        elif path.startswith(_LIBRARY_CODE[0]) or (path.startswith(_LIBRARY_CODE[1])
                                                   and "-packages" + os.sep not in path[len(_LIBRARY_CODE[1]):]):
            kind = "library"
        else:
            kind = "user"
        _code_kinds[filename] = kind
    return kind


def _innermost_user_frame(summary: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame of ``summary`` (outermost first) in the user's code, looking outward no further than
    adaptdist's step (whose callers, e.g. a script calling ``compile_model``, are not the traced code)."""
    for f in reversed(summary):
        kind = _code_kind(f.filename)
        if kind == "user":
            return f
        if kind == "step":
            return None
    return None


def _traceback_frames(text: str) -> list[tuple[str, int, str]]:
    """``(file, line, code)`` of each frame of a formatted stack trace, outermost first."""
    return [(f, int(n), code.strip())
            for f, n, code in re.findall(r'File "([^"]+)", line (\d+), in \S+\n([^\n]*)', text)]


def _copy_sources(gm: torch.fx.GraphModule, first: list[torch.fx.GraphModule]) -> None:
    """Give each node of the re-traced joint graph ``gm`` the :data:`SOURCE_META` of the first-trace node its
    stack trace names (the re-trace's stack trace ends in that node's line of generated code, ``name = ...``).
    A backward node takes its forward node's (the first forward node of its ``seq_nr``); a forward node outside
    every module of the root (whose own forward is module path '') is the loss function's (:data:`LOSS_PATH`)."""
    if not first:
        return
    nodes = [n for n in first[-1].graph.nodes if n.op == "call_function"]
    fwd: dict[int, torch.fx.Node] = {}
    for n in nodes:
        if n.meta.get("partitioner_tag") != "is_backward" and n.meta.get("seq_nr") is not None:
            fwd.setdefault(n.meta["seq_nr"], n)
    tracked = any(n.meta.get("nn_module_stack") for n in nodes)  # the module hooks saw the model's forward
    source: dict[str, tuple] = {}
    for n in nodes:
        f = fwd.get(n.meta.get("seq_nr")) if n.meta.get("partitioner_tag") == "is_backward" else n
        if f is None:
            continue
        stack = f.meta.get("nn_module_stack") or {}
        frame = _user_frame(n.meta.get("stack_trace")) or _user_frame(f.meta.get("stack_trace"))
        if stack:
            path, cls = list(stack.values())[-1]
        elif tracked:
            path, cls = LOSS_PATH, None
        else:
            path, cls = "", None
        if frame is None and not stack and not tracked:
            continue
        source[n.name] = (path, getattr(cls, "__name__", ""), *(frame or ("", 0, "")))
    for n in gm.graph.nodes:
        lines = (n.meta.get("stack_trace") or "").rstrip().splitlines()
        m = _RETRACED_LINE.match(lines[-1]) if lines else None
        if m and m.group(1) in source:
            n.meta[SOURCE_META] = source[m.group(1)]


class _FrameWalkTraceback:
    """What ``torch.fx.proxy`` needs of ``torch.utils._traceback.CapturedTraceback``
    (``CapturedTraceback.extract().summary()``, once per node it creates), computed by walking
    the Python frames instead of gathering and symbolizing a traceback in C++.

    ``summary()`` lists the same frames as CapturedTraceback's: outermost first, one
    ``FrameSummary(co_filename, current line, co_name)`` each. It is cheaper in two ways:
    the source line of a frame is read from ``linecache`` when first used (by ``format()``, for
    the one or two frames of the ~40 the tracer keeps), not for every frame; and the current
    line of a frame running a very long function (the generated ``forward`` of a joint graph,
    thousands of lines, which aot re-traces node by node) comes from a table of that code's line
    ranges instead of CPython's scan of its line table from the start on every lookup, which
    made recording stack traces quadratic in the number of nodes.
    """

    __slots__ = ("_frames",)
    # id(code) -> (code, (range starts, range lines)) for long code, (code, None) for short
    # (the code is held so that its id stays its own); emptied by _fast_fx_stack_traces
    _line_tables: dict[int, tuple[Any, tuple[list[int], list[int | None]] | None]] = {}
    _LONG_LINETABLE = 2048  # bytes of co_linetable above which a table beats f_lineno

    def __init__(self, frames: list) -> None:
        self._frames = frames

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> Any:
        from torch.utils._traceback import CapturedTraceback

        if script or cpp:  # TorchScript/C++ frames: only torch's own can gather those
            return CapturedTraceback.extract(script=script, cpp=cpp, skip=skip)
        tables = _FrameWalkTraceback._line_tables
        frames = []
        f = sys._getframe(1 + skip)  # the caller, as CapturedTraceback.extract elides itself
        while f is not None:
            code = f.f_code
            entry = tables.get(id(code))
            if entry is None or entry[0] is not code:
                entry = tables[id(code)] = (code, _FrameWalkTraceback._line_table(f))
            line = _FrameWalkTraceback._lookup(entry[1], f) if entry[1] is not None else None
            frames.append((code.co_filename, f.f_lineno if line is None else line, code.co_name))
            f = f.f_back
        return _FrameWalkTraceback(frames)

    @staticmethod
    def _lookup(table: tuple[list[int], list[int | None]], f: Any) -> int | None:
        """The line ``f`` is at, from its code's table; None where ``f.f_lineno`` must say."""
        if f.f_trace is not None or f.f_lasti < 0:  # traced by a debugger, or not started
            return None
        i = bisect.bisect_right(table[0], f.f_lasti) - 1
        return table[1][i] if i >= 0 else None

    @staticmethod
    def _line_table(f: Any) -> tuple[list[int], list[int | None]] | None:
        """(start offsets, lines) of the line ranges of a long code running in frame ``f``; None
        for short code, or where the table disagrees with ``f.f_lineno`` (a Python whose
        ``co_lines``/``f_lasti`` mean something else)."""
        code = f.f_code
        if len(code.co_linetable) <= _FrameWalkTraceback._LONG_LINETABLE:
            return None
        starts, lines = [], []
        for start, _end, line in code.co_lines():
            starts.append(start)
            lines.append(line)
        table = (starts, lines)
        line = _FrameWalkTraceback._lookup(table, f)
        return table if line is None or line == f.f_lineno else None

    def summary(self) -> traceback.StackSummary:
        summary = traceback.FrameSummary
        return traceback.StackSummary(
            [summary(filename, line, name, lookup_line=False) for filename, line, name in reversed(self._frames)]
        )


@contextlib.contextmanager
def _fast_fx_stack_traces():
    """Within: FX tracers record ``node.meta["stack_trace"]`` through ``_FrameWalkTraceback``
    (``torch.fx.proxy`` looks ``CapturedTraceback`` up as a module global on every node it
    creates). A torch without that global records them its own way."""
    import torch.fx.proxy as fx_proxy

    prior = getattr(fx_proxy, "CapturedTraceback", None)
    if prior is None or prior is _FrameWalkTraceback or not hasattr(prior, "extract"):
        yield  # no such global, or an enclosing (or concurrent) capture already swapped it
        return
    fx_proxy.CapturedTraceback = _FrameWalkTraceback
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = prior
        _FrameWalkTraceback._line_tables.clear()  # holds the traced graphs' code objects


def fake_tensor_mode(allow_constants: bool = False) -> Any:
    """A fresh FakeTensorMode (shapes and dtypes only, no storage).

    ``allow_constants``: real tensors the traced code closes over (a loss's class
    weights, say) are accepted and become constants of the graph.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_constants)


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def reparametrize(module: torch.nn.Module, tensors: dict[str, torch.Tensor], tie_weights: bool = True):
    """Context manager: temporarily swap the module's parameters/buffers by name (with ``tie_weights``, a
    tensor given under one of its names replaces it under all of them).

    The originals come back in the reverse order of the swaps (``stack_weights``): a module registered
    under two names (``self.b = self.a``) has one slot under both, and restoring in swap order would put
    back the first swap's tensor (a fake or traced one) instead of the original.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=tie_weights, stack_weights=True)


def fx_code_globals() -> dict[str, Any]:
    """The names FX-generated code refers to (``torch``, ``device``, ``inf``, ...)."""
    from torch.fx.graph import _custom_builtins

    return {name: b.obj for name, b in _custom_builtins.items()}


def register_process_group(name: str, group: Any) -> None:
    """Make ``group`` resolvable by ``name`` in functional collectives (``_c10d_functional.*``);
    a name registered before (an earlier program's mesh) is re-pointed."""
    torch._C._distributed_c10d._unregister_process_group(name)  # a no-op for an unknown name
    torch._C._distributed_c10d._register_process_group(name, group)


def release_import_time_default_groups() -> int:
    """Drop the references to the default process group that ``torch.distributed.nn.functional`` takes when
    it is first imported after ``init_process_group`` (its collectives are declared ``group=group.WORLD``,
    which Python evaluates at import time; ``import torch._dynamo``, i.e. the first ``torch.compile``,
    imports it). Each such default becomes None, which those functions read as the default group, the same
    group while it lives. Returns how many defaults were replaced.

    Why: while anything references a gloo group, ``destroy_process_group()`` cannot free it, so its worker
    threads run on into interpreter finalization; one that then releases a finished work's tensors needs
    the GIL, and Python ends that thread from under C++ code: "terminate called without an active
    exception" (SIGABRT) at exit, now and then, on some rank.
    """
    import torch.distributed as dist

    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None or not dist.is_available():
        return 0
    replaced = 0
    for obj in list(vars(mod).values()):
        fn = obj
        while callable(fn):  # the function and the functions it wraps (functools.wraps' __wrapped__)
            defaults = getattr(fn, "__defaults__", None) or ()
            if any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
                replaced += sum(isinstance(d, dist.ProcessGroup) for d in defaults)
            fn = getattr(fn, "__wrapped__", None)
    return replaced


def resolve_process_group(name: str) -> Any:
    """The process group registered under ``name`` (see :func:`register_process_group`)."""
    return torch._C._distributed_c10d._resolve_process_group(name)


def unregister_all_process_groups() -> None:
    torch._C._distributed_c10d._unregister_all_process_groups()


def functional_all_reduce_op() -> Callable:
    return torch.ops._c10d_functional.all_reduce.default


def functional_all_gather_op() -> Callable:
    """``all_gather_into_tensor(x, group_size, group_name)``: concatenates equal-sized shards on dim 0."""
    return torch.ops._c10d_functional.all_gather_into_tensor.default


def functional_reduce_scatter_op() -> Callable:
    """``reduce_scatter_tensor(x, op, group_size, group_name)``: sums over ranks, rank r keeps block r of dim 0."""
    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def functional_all_to_all_op() -> Callable:
    """``all_to_all_single(x, output_split_sizes, input_split_sizes, group_name)``: rank r sends block d of
    dim 0 to rank d and receives each rank's block r, concatenated on dim 0 in rank order."""
    return torch.ops._c10d_functional.all_to_all_single.default


def functional_wait_op() -> Callable:
    return torch.ops._c10d_functional.wait_tensor.default


_FUNCTIONAL_COLLECTIVES = (
    ("all_reduce", "all_reduce"), ("all_reduce_coalesced", "all_reduce"),
    ("all_gather_into_tensor", "all_gather"), ("all_gather_into_tensor_coalesced", "all_gather"),
    ("reduce_scatter_tensor", "reduce_scatter"), ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
    ("all_to_all_single", "all_to_all"), ("broadcast", "broadcast"), ("wait_tensor", "wait"),
)
"""Functional collective op name (``torch.ops._c10d_functional.<name>``) -> the collective it issues."""


@functools.cache
def _functional_collective_kinds() -> dict[Any, str]:
    kinds = {}
    for name, kind in _FUNCTIONAL_COLLECTIVES:
        packet = getattr(torch.ops._c10d_functional, name, None)
        if packet is None:  # an op this torch does not have
            continue
        for overload in packet.overloads():
            kinds[getattr(packet, overload)] = kind
    return kinds


def functional_collective_kind(target: Any) -> str | None:
    """The collective a functional collective op issues (``"all_reduce"``, ``"all_gather"``,
    ``"reduce_scatter"``, ``"all_to_all"``, ``"broadcast"``), ``"wait"`` for ``wait_tensor``, None for any
    other target. Matched by op handle (``torch.ops._c10d_functional.*`` overloads), not by name."""
    try:
        return _functional_collective_kinds().get(target)
    except TypeError:  # an unhashable target (a method name string is hashable; a bound method may not be)
        return None


def is_functional_collective(target: Any) -> bool:
    """True for a functional collective that issues communication (not ``wait_tensor``)."""
    return functional_collective_kind(target) not in (None, "wait")


@contextlib.contextmanager
def no_dispatch():
    from torch.utils._mode_utils import no_dispatch as _nd

    with _nd():
        yield


def torch_dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: sees every ATen op a region runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def trace_fake(fn: Callable, specs: list[tuple[list[int], torch.dtype]],
               device: "torch.device | str" = "cpu") -> torch.fx.GraphModule:
    """Trace ``fn`` to an ATen GraphModule on fake tensors of the given (shape, dtype) on ``device`` (no real
    compute; a fake cuda tensor needs no GPU)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = fake_tensor_mode()
    with mode:
        inputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    return make_fx(fn, tracing_mode="fake")(*inputs)


def flop_formula_registry() -> dict[Any, Callable]:
    """A copy of ``torch.utils.flop_counter.flop_registry``: op overload packet -> FLOP formula.

    Each formula is called as ``formula(*args, out_val=out, **kwargs)`` with tensors or shapes
    in place of tensors (torch's ``shape_wrapper`` maps tensors to their shapes and leaves shapes as
    they are) and returns FLOPs. Used as is by ``FlopCounterMode``.
    """
    from torch.utils.flop_counter import flop_registry

    return dict(flop_registry)


def flop_shape_wrapper(formula: Callable) -> Callable:
    """``torch.utils.flop_counter.shape_wrapper``: lets a formula written on shapes take tensors too."""
    from torch.utils.flop_counter import shape_wrapper

    return shape_wrapper(formula)


def mark_flop_formula_raw(formula: Callable) -> Callable:
    """Set ``FlopCounterMode``'s private ``_get_raw`` flag on ``formula`` (it then calls the formula as it is,
    on tensors or shapes, instead of wrapping it in ``shape_wrapper`` a second time); returns it."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage (its StorageImpl), shared by all views of it; valid while ``t`` lives."""
    return t.untyped_storage()._cdata


def dtensor_strategies(op: Any, args: tuple, kwargs: dict, mesh_size: int = 2
                       ) -> list[tuple[list[Any], list[Any]]] | None:
    """DTensor's sharding strategies for ``op`` along one mesh axis, as (outputs, tensor inputs) lists of
    DTensor placements (``Shard``/``Replicate``/``Partial``; ``None`` where an output is absent).

    ``args``/``kwargs`` hold tensors (real or fake) where the op takes tensors. Uses the op's
    single-mesh-dim strategy (``register_single_dim_strategy``; sharding placeholders become
    ``Shard``, DTensor's masked partial of a vocabulary-parallel lookup becomes ``Partial``), else
    its full strategy function evaluated on a 1-D mesh of ``mesh_size`` ranks built without a
    process group, with every input offered as Replicate, Shard(d) for each dim, and Partial.
    Returns None when DTensor has no strategy for the op, or its strategy function fails on
    these arguments (e.g. an argument form it does not expect).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy
    try:  # single-mesh-dim strategies (and their placeholder) are newer than some torch versions adaptdist runs on
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    except ImportError:
        class _ShardingPlaceholder:  # never an instance: such a torch registers no single-dim strategies
            dim = 0

    prop = DTensor._op_dispatcher.sharding_propagator

    def meta(t: torch.Tensor) -> Any:
        return TensorMeta(t.shape, t.stride(), t.dtype)

    def plain(p: Any, is_input: bool) -> Any:
        if isinstance(p, _ShardingPlaceholder):
            return Shard(p.dim)
        if isinstance(p, Partial) and type(p) is not Partial:
            # _MaskPartial: on the indices of a vocabulary-parallel lookup it means "replicated,
            # masked locally"; on its output, a partial sum
            return Replicate() if is_input else Partial(p.reduce_op)
        return p

    single = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    try:
        if single is not None:
            rows = single.func(op, tree_map(lambda a: meta(a) if isinstance(a, torch.Tensor) else a, args),
                               tree_map(lambda a: meta(a) if isinstance(a, torch.Tensor) else a, kwargs))
            n_in = sum(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
            n_out = [len(row) - n_in for row in rows]
            return [([plain(p, False) for p in row[:k]], [plain(p, True) for p in row[k:]])
                    for row, k in zip(rows, n_out)]
        full = prop.op_strategy_funcs.get(op)
        if full is None:
            return None
        try:
            mesh = DeviceMesh("cpu", torch.arange(mesh_size), _init_backend=False, _rank=0)
        except TypeError:  # a torch whose DeviceMesh takes no _rank: it asks the default group, absent here
            mesh = DeviceMesh("cpu", torch.arange(mesh_size), _init_backend=False)

        def offer(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            cands = [Replicate()] + [Shard(d) for d in range(a.dim())] + [Partial()]
            return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), meta(a))) for p in cands])

        result = full(OpSchema(op, tree_map(offer, args), tree_map(offer, kwargs)))
    except Exception as e:  # DTensor's strategy does not take this argument form: the caller uses our rule
        logging.getLogger("adaptdist.passes").debug("DTensor strategy for %s refused its arguments: %s: %s",
                                                    op, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    out = []
    for spec in getattr(result, "strategies", []):
        outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,)
        outs = [None if o is None else o.placements[0] for o in outs]
        ins = [i.placements[0] for i in (spec.input_specs or ())]
        out.append((outs, ins))
    return out


def dtensor_redistribute_cost(src: Any, dst: Any, shape: tuple[int, ...], dtype: torch.dtype,
                              mesh_size: int = 2) -> float:
    """DTensor's estimate of the cost of redistributing a tensor from placement ``src`` to ``dst``
    (DTensor placements) on a 1-D mesh of ``mesh_size`` ranks (``_collective_utils.redistribute_cost``:
    an alpha-beta estimate in microseconds; 0 when nothing moves)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._collective_utils import redistribute_cost
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh("cpu", torch.arange(mesh_size), _init_backend=False, _rank=0)
    stride = torch.empty(shape, device="meta").stride()
    tm = TensorMeta(torch.Size(shape), stride, dtype)
    return float(redistribute_cost(DTensorSpec(mesh, (src,), tm), DTensorSpec(mesh, (dst,), tm)))


def dtensor_placement(p: Any) -> Any:
    """One of adaptdist's placements (Shard/Replicate/Partial, by duck type) as DTensor's."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    name = type(p).__name__
    if name == "Shard":
        return Shard(p.dim)
    if name == "Partial":
        return Partial(p.op)
    return Replicate()


def dynamo_source_name(placeholder: Any) -> str | None:
    """The source text (``L['self']._modules['fc']._parameters['weight']``) of a Dynamo graph
    placeholder, from ``node.meta["grapharg"]``; None when Dynamo recorded none."""
    arg = placeholder.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name


def dynamo_graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph-break reasons so far in this process (first line of each) -> count."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    # A branch on a tensor's data (``if t.sum() > 0``) breaks the graph through Dynamo's jump handler, which
    # leaves its reason under "unimplemented" (symbolic_convert.generic_jump: compiled, never moved to
    # "graph_break" as the other breaks are); under fullgraph=True it is an error instead.
    jumps = {r: c for r, c in counters["unimplemented"].items() if str(r).startswith("Data-dependent branching")}
    for reason, count in [*counters["graph_break"].items(), *jumps.items()]:
        key = str(reason).strip().split("\n")[0]
        out[key] = out.get(key, 0) + count
    return out


def sdpa_math_only():
    """Context manager: ``scaled_dot_product_attention`` runs its math form (matmul, softmax), which
    torch.vmap batches; torch's fused CPU kernel has no vmap rule (vmap would loop over the batch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def autocast_states() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions in effect: ``(device type, dtype)`` for each device type whose autocast is enabled
    (``torch.is_autocast_enabled(device)``), in torch's order of supported devices; ``()`` when none is."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in torch._C._autocast_supported_devices()
                 if torch.is_autocast_enabled(d))


def is_autocast_node(node: torch.fx.Node) -> bool:
    """Whether a Dynamo graph node enters or leaves an autocast region written inside the compiled code
    (Dynamo records ``with torch.autocast(...)`` as ``torch.amp.autocast_mode._enter_autocast`` /
    ``_exit_autocast`` calls)."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name in ("_enter_autocast", "_exit_autocast")


@contextlib.contextmanager
def autocast_disabled():
    """Within: autocast off on every device type (as aot_autograd's ``disable_autocast``), so that a graph
    whose casts are explicit ATen ops is run or traced as it is, not cast again."""
    with contextlib.ExitStack() as stack:
        for d in torch._C._autocast_supported_devices():
            if torch.is_autocast_enabled(d):
                stack.enter_context(torch.amp.autocast(d, enabled=False))
        yield


def retrace_aten(fn: Callable, args: list) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` (tensors of an active FakeTensorMode) into an ATen GraphModule under the autocast
    state in effect, so every cast autocast makes is an explicit ``_to_copy`` node (source:
    ``torch.fx.experimental.proxy_tensor.make_fx``, which aot_autograd traces with too). Placeholders keep
    ``fn``'s argument order; outputs its structure; ``node.meta["val"]`` holds fake values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="real", _allow_non_fake_inputs=True)(*args)


def vmap_unwrap(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """Inside ``torch.vmap``: ``(physical, level)``, the tensor of every vmapped example of ``t`` at once, its
    vmapped dim moved to 0, and vmap's level (for :func:`vmap_wrap`); ``(t, None)`` for a tensor vmap does not
    batch. Ops on ``physical`` see every example (a sum over dim 0 mixes them) and are differentiable as usual.
    Source: ``torch._C._functorch._unwrap_batched`` (what ``torch._functorch.vmap`` uses)."""
    import torch._C._functorch as functorch

    level = functorch.maybe_get_level(t)
    if level is None or level < 0 or not functorch.is_batchedtensor(t):
        return t, None
    physical, bdim = functorch._unwrap_batched(t, level)
    return physical.movedim(bdim, 0), level


def vmap_wrap(physical: torch.Tensor, level: int) -> torch.Tensor:
    """The inverse of :func:`vmap_unwrap`: ``physical``'s dim 0 as the vmapped dim at ``level``."""
    import torch._C._functorch as functorch

    return functorch._add_batch_dim(physical, 0, level)


def _mark(key: str, total: int) -> int:
    from torch._dynamo.utils import counters

    before = counters["adaptdist"][key]
    counters["adaptdist"][key] = max(before, total)
    return before


def graph_breaks_reported(total: int) -> int:
    """How many graph breaks adaptdist had reported before this call, and record ``total`` as reported.
    Kept beside Dynamo's own break counters (``torch._dynamo.utils.counters``), so it lives and is
    cleared with them."""
    return _mark("graph_breaks_reported", total)


def new_graph_break_reasons() -> list[str]:
    """The graph-break reasons (first lines, as :func:`dynamo_graph_break_reasons`) whose Dynamo count rose since
    the last call, and record the current counts (beside Dynamo's counters, as above)."""
    from torch._dynamo.utils import counters

    now = dynamo_graph_break_reasons()
    seen = counters["adaptdist_graph_break_reasons_noted"]
    new = [r for r, c in now.items() if c > seen[r]]
    for r, c in now.items():
        seen[r] = c
    return new


def note_graph_break(site: str, reason: str) -> None:
    """Record one graph break: the graph that ends at ``site`` ended there for ``reason`` (as above)."""
    from torch._dynamo.utils import counters

    counters["adaptdist_graph_break_sites"][(site, reason)] += 1


def graph_break_sites() -> dict[tuple[str, str], int]:
    """The graph breaks noted so far: (site, reason) -> how many graphs ended there so."""
    from torch._dynamo.utils import counters

    return dict(counters["adaptdist_graph_break_sites"])


def drop_tensor_guards(source_names: set[str]) -> int:
    """Remove the TENSOR_MATCH guards (dtype, device, sizes, strides) Dynamo is about to install on the
    named sources of the frame being compiled; returns how many were removed. Called from a backend (inside
    Dynamo's compile of the frame). The adaptdist backend gives a parameter its shard after the first call;
    with the size guard in place Dynamo would re-trace the user's code, written for the full shape."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None or not source_names:
        return 0
    guards = ctx.guards_context.dynamo_guards
    drop = [g for g in guards.inner if g.name in source_names and g.create_fn_name() == "TENSOR_MATCH"]
    for g in drop:
        guards.inner.remove(g)
    return len(drop)


def dynamo_root_module() -> Any:
    """The module whose ``forward`` Dynamo is compiling (its ``self``), called from inside a backend; None when
    the compiled frame is not a module's method (e.g. a decorator's ``wrapped(*args, **kwargs)`` around it, as
    Hugging Face models' forwards are: :func:`dynamo_compiled_wrapper` finds their module)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:
        return None
    code = getattr(tx, "f_code", None)
    if code is None:
        return None
    f_locals = getattr(tx, "f_locals", {})
    # a torch.nn.* module (nn.Sequential, ...) is compiled through external_utils.wrap_inline: the frame is
    # its ``inner(*args, **kwargs)``, calling the module held in the closure variable ``fn``
    wrapped = f_locals.get("fn") if code.co_name == "inner" and code.co_argcount == 0 else None
    if isinstance(wrapped, torch.nn.Module):
        return wrapped
    if code.co_argcount == 0:
        return None
    candidate = f_locals.get(code.co_varnames[0])
    return candidate if isinstance(candidate, torch.nn.Module) else None


def dynamo_compiled_wrapper(module: Any = None) -> Any:
    """The ``torch.compile`` wrapper (``OptimizedModule``) whose call is compiling ``module`` (any module:
    the innermost wrapper whose call is in progress), from inside a backend: found on the Python call stack
    (its ``__call__`` runs the wrapper's own hooks eagerly, then the compiled frame); None when there is
    none (a compiled function, or a module's method compiled directly)."""
    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, OptimizedModule) and (module is None or candidate._orig_mod is module):
            return candidate
        frame = frame.f_back
    return None


def dynamo_root_is_wrapped() -> bool:
    """Whether the frame Dynamo compiles is external_utils.wrap_inline's ``inner`` around a torch.nn module
    (the module's hooks are then traced, not run before the frame)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:
        return False
    code = getattr(tx, "f_code", None)
    return (code is not None and code.co_name == "inner"
            and isinstance(getattr(tx, "f_locals", {}).get("fn"), torch.nn.Module))


def dynamo_frame_is_resume() -> bool:
    """Whether the frame Dynamo is compiling resumes a function after a graph break (from a backend)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        code = getattr(InstructionTranslator.current_tx(), "f_code", None)
    except AttributeError:
        return False
    return code is not None and "resume_in" in code.co_name


def dynamo_frame() -> tuple[str, str, int] | None:
    """The frame Dynamo is compiling, from a backend: (function name, file, first line); a resume function after a
    graph break is named ``torch_dynamo_resume_in_<function>_at_<line>``. None outside a compile."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        code = getattr(InstructionTranslator.current_tx(), "f_code", None)
    except AttributeError:
        return None
    return None if code is None else (code.co_name, code.co_filename, code.co_firstlineno)


def dynamo_recompile_reason() -> str | None:
    """Why Dynamo is compiling this frame again (the first failed guard of its cached graphs, as
    ``TORCH_LOGS=recompiles`` prints it), from a backend; None at a frame's first compile or where this torch
    does not record it (``torch._dynamo.utils.get_metrics_context``)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception:
        return None
    return reason if isinstance(reason, str) else None


def in_compiled_module_call() -> bool:
    """Whether a ``torch.compile``d module's call is in progress (so a module's forward hook runs for the
    compiled model, not for an eager call of the original module)."""
    from torch._dynamo.eval_frame import _is_in_optimized_module

    return _is_in_optimized_module()


def default_group_store() -> Any:
    """The store of the default process group (``distributed_c10d._get_default_store``): the store of the job's
    rendezvous, under the default group's key prefix. Raises RuntimeError when no default group exists."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def default_group_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds (its CPU backend's options); None when there
    is no default group or this torch keeps it elsewhere."""
    import torch.distributed.distributed_c10d as c10d

    try:
        backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except Exception:
        return None


def device_mesh_without_groups(device_type: str, ranks: torch.Tensor, mesh_dim_names: tuple[str, ...]) -> Any:
    """torch's DeviceMesh over ``ranks`` (global ranks, one tensor dim per mesh dim) that creates no process
    groups (DeviceMesh's private ``_init_backend=False``; it still knows this rank's coordinates): enough to
    describe DTensors to torch.distributed.checkpoint, which computes each rank's box from the coordinates
    and communicates over the default group. A collective on this mesh fails."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _init_backend=False)


def dynamo_reset() -> None:
    """Forget every graph Dynamo compiled in this process (``torch._dynamo.reset()``): the next
    ``torch.compile`` call traces afresh, with no automatic dynamic shapes learnt from earlier models."""
    import torch._dynamo

    torch._dynamo.reset()


def on_dynamo_frame_compiled(callback) -> None:
    """Run ``callback(args)`` at the end of every Dynamo frame compile in this process, successful or not
    (``torch._dynamo.callback_handler``); registering the same function twice registers it once."""
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    if callback not in handler.end_callbacks:
        handler.register_end_callback(callback)


def on_dynamo_frame_compile_start(callback) -> None:
    """Run ``callback(args)`` at the start of every Dynamo frame compile in this process, before it traces
    (``torch._dynamo.callback_handler``); registering the same function twice registers it once."""
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    if callback not in handler.start_callbacks:
        handler.register_start_callback(callback)


def dynamo_failed_compile() -> tuple[Any, Any, dict, BaseException] | None:
    """From an end callback of :func:`on_dynamo_frame_compiled`: the frame compile that is ending with an error that
    will reach the caller of the compiled code, as (its backend as passed to ``torch.compile``, the frame's code,
    its locals at entry, the error); None when the compile succeeds, or fails in a way Dynamo handles itself (a
    graph break's ``Unsupported`` or ``UserError``: the frame then runs eagerly) or that the backend raised
    (``BackendCompilerFailed``: the backend's own error; or a ``ShortenTraceback``, its base, which
    :func:`through_dynamo` gives the errors the ranks already agreed on). The compile is ``_compile`` in
    ``torch/_dynamo/convert_frame.py``, found on the call stack: its ``compile_inner`` runs the end callbacks as
    the error leaves it (``callback.py``'s ``install_callbacks``), so the error in flight must have passed through
    that frame (not an error the caller's own ``except`` block is handling)."""
    from torch._dynamo.eval_frame import innermost_backend
    from torch._dynamo.exc import ShortenTraceback, Unsupported, UserError

    error = sys.exc_info()[1]
    if not isinstance(error, Exception) or isinstance(error, (ShortenTraceback, Unsupported, UserError)):
        return None
    source = os.path.join("_dynamo", "convert_frame.py")
    inner = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(source):
            if code.co_name == "compile_inner":
                inner = frame
            elif code.co_name == "_compile" and inner is not None:
                tb = error.__traceback__
                while tb is not None and tb.tb_frame is not inner:
                    tb = tb.tb_next
                if tb is None:
                    return None
                backend = innermost_backend(frame.f_locals.get("compiler_fn"))
                return (getattr(backend, "compiler_fn", backend), frame.f_locals.get("code"),
                        dict(frame.f_locals.get("locals") or {}), error)
        frame = frame.f_back
    return None


def dynamo_active_backend() -> Any:
    """The backend of the ``torch.compile`` call running on this thread (the object passed as ``backend=``, or
    the one registered under its name), from eager code that call runs; None outside one, or inside a
    ``torch._dynamo.disable`` region. ``torch.compile`` wraps a backend in ``_TorchCompileWrapper`` (``compiler_fn``)
    inside Dynamo's frame callback (``_torchdynamo_orig_backend`` chain)."""
    callback = _get_eval_frame_callback()  # imported once: eager code may ask at every module call
    if callback is None or isinstance(callback, bool):
        return None
    from torch._dynamo.eval_frame import innermost_backend

    inner = innermost_backend(callback)
    return getattr(inner, "compiler_fn", inner)


def dynamo_run_only_backend() -> Any:
    """The backend of the ``torch.compile`` call whose frame Dynamo runs without compiling, from eager code that
    frame calls; None otherwise. Past ``torch._dynamo.config.recompile_limit`` Dynamo runs a frame and everything
    it calls with ``FrameAction.RUN_ONLY`` (cached code only): the thread's frame callback is then ``False``, so
    :func:`dynamo_active_backend` cannot see the backend. It is found on the call stack instead: the compiled
    call's ``compile_wrapper`` (``_TorchDynamoContext.__call__`` in ``torch/_dynamo/eval_frame.py``) holds its
    ``callback``. Like :func:`dynamo_active_backend` its frame must run with Dynamo's callback as the caller's
    (:func:`install_global_forward_pre_hook` marks it so)."""
    if _get_eval_frame_callback() is not False:
        return None
    from torch._dynamo.eval_frame import innermost_backend

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
            callback = frame.f_locals.get("callback")
            if callback is not None and not isinstance(callback, bool):
                inner = innermost_backend(callback)
                return getattr(inner, "compiler_fn", inner)
        frame = frame.f_back
    return None


def dynamo_recompile_limit() -> int:
    """``torch._dynamo.config.recompile_limit``: how many times Dynamo compiles one frame before it runs the frame
    uncompiled (``cache_size_limit`` before torch 2.6)."""
    import torch._dynamo

    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def dynamo_runs_forward_eagerly(module: torch.nn.Module) -> bool:
    """Whether Dynamo runs ``module``'s ``forward`` as it is when eager code calls the module during a compiled
    call (a frame of its own), rather than compiling it: torch.nn's own modules (its trace rules skip torch.nn
    files as frames; they are only inlined) unless they have forward hooks of their own; a user module's
    ``forward`` is compiled (``trace_rules.check_verbose``)."""
    from torch._dynamo import trace_rules
    from torch._dynamo.utils import nnmodule_has_hooks

    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is None or not trace_rules.check(code):
        return False
    return not (type(module).__module__.startswith(("torch.nn.", "torch.ao."))
                and nnmodule_has_hooks(module, check_forward_hooks=True))


def install_global_forward_pre_hook(hook: Callable, helpers: tuple[Callable, ...] = ()) -> Any:
    """Register ``hook`` as a forward pre-hook of every module in this process, unless it already is (by
    identity); returns the handle, or None when it was there.

    Dynamo must not compile the hook's frame when eager code calls it during a compiled call: it would fold
    ``torch.compiler.is_compiling()`` to True there. So its code is marked skipped (where Dynamo traces a module
    call, it still inlines the hook). The frames the hook calls would each be compiled too: ``helpers`` (which
    must not ask :func:`dynamo_active_backend`: Dynamo's callback is off in them) are skipped with everything
    they call; the hook must call nothing else of its own (no comprehension: a frame of its own in Python 3.11).
    torch warns at every call of a ``torch.compile``'d module while any global hook exists ("...this will cause
    the hooks to fire an extra time for the OptimizedModule"): the hook must ignore the OptimizedModule (its
    call runs before the compiled frame, outside it, where :func:`dynamo_active_backend` is None), and that
    warning is filtered."""
    import warnings

    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    from torch.nn.modules import module as nn_module

    if any(h is hook for h in nn_module._global_forward_pre_hooks.values()):
        return None
    for code in (hook.__code__, dynamo_active_backend.__code__, dynamo_run_only_backend.__code__):
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT))
    for helper in (*helpers, dynamo_runs_forward_eagerly):
        set_code_exec_strategy(helper.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
                            category=UserWarning)
    return nn_module.register_module_forward_pre_hook(hook)


def remove_global_forward_pre_hook(hook: Callable) -> int:
    """Remove every registration of ``hook`` as a global forward pre-hook (by identity); returns how many."""
    from torch.nn.modules import module as nn_module

    keys = [k for k, h in nn_module._global_forward_pre_hooks.items() if h is hook]
    for k in keys:
        del nn_module._global_forward_pre_hooks[k]
    return len(keys)


def raise_at_frame_compile_end(error: Exception) -> None:
    """Raise ``error`` from an end callback of :func:`on_dynamo_frame_compiled`, leaving Dynamo able to compile
    (and ``torch._dynamo.reset()``) afterwards: its handler counts pending compiles and decrements the count only
    after the end callbacks return (``callback.py``, ``install_callbacks``), so a raising callback would leave it
    one too high: no later callback would run and ``reset()`` would fail. Takes that count back first. The error
    reaches the caller of the compiled code as itself (:func:`through_dynamo`), not wrapped in Dynamo's
    ``InternalTorchDynamoError``."""
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    name = "_CompilationCallbackHandler__pending_callbacks_counter"
    if getattr(handler, name, 0) > 0:
        setattr(handler, name, getattr(handler, name) - 1)
    raise through_dynamo(error)


def through_dynamo(error: Exception) -> Exception:
    """``error`` as an exception that Dynamo hands to the caller of the compiled code unchanged, so the user sees
    (and can catch) adaptdist's typed error: Dynamo rewraps any other error raised while it compiles a frame (an
    end callback's, in ``_compile`` of ``convert_frame.py``) as ``InternalTorchDynamoError``, and a backend's
    (``call_user_compiler`` of ``output_graph.py``) as ``BackendCompilerFailed``; both re-raise its
    ``ShortenTraceback`` as it is, and the compiled function's wrapper (``eval_frame.py``) raises it ``from None``.

    Returns an instance of a subclass of ``type(error)`` and of ``ShortenTraceback`` with the same name, module,
    message, attributes and cause (``isinstance(e, type(error))`` holds, and the traceback's last line reads
    ``adaptdist.errors.RankInputMismatchError: ...``; pickled, it is the plain error); ``error`` itself where it
    already passes, or where its type cannot be combined with Dynamo's (a built-in of another layout)."""
    from torch._dynamo.exc import ShortenTraceback

    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    dynamo_fields = ("first_useful_frame", "_torch_dynamo_tracer_output", "frame_exec_strategy")

    def reduce(self: Exception) -> tuple:  # pickled (a rank's error sent to its launcher) as the plain error
        return cls, tuple(self.args), {k: v for k, v in self.__dict__.items() if k not in dynamo_fields}

    try:
        passing = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__,
                                                               "__qualname__": cls.__qualname__,
                                                               "__reduce__": reduce})
    except TypeError:
        return error
    out = Exception.__new__(passing)
    out.args = error.args
    out.__dict__.update(error.__dict__)
    out.first_useful_frame = None  # ShortenTraceback: keep the whole traceback
    out._torch_dynamo_tracer_output = None  # TorchDynamoException's attributes, which its __init__ would set
    out.frame_exec_strategy = None
    out.__cause__ = error.__cause__
    out.__traceback__ = error.__traceback__
    return out


def new_skipped_frames() -> list[str]:
    """Dynamo's reasons for frames it skipped (ran eagerly, uncompiled: a graph break inside a for/while loop
    cannot be resumed) since the last call; each reason's text names the frame ("frame skipped: forward
    (file.py line N)") and the graph break that caused it."""
    from torch._dynamo.utils import counters

    seen = counters["adaptdist_skipped_frames_noted"]
    new = [str(r) for r, c in counters["unimplemented"].items() if "frame skipped" in str(r) and c > seen[r]]
    for r, c in counters["unimplemented"].items():
        seen[r] = c
    return new


def dynamo_unsupported_reasons() -> list[str]:
    """The first line of each construct Dynamo gave up on in this process (``counters["unimplemented"]``), oldest
    first: why it broke a graph or skipped a frame."""
    from torch._dynamo.utils import counters

    return [str(r).strip().split("\n")[0] for r in counters["unimplemented"]]


def compile_session():
    """A context in which ``torch.compiler.is_compiling()`` is True, as Dynamo holds it while it compiles: library
    code that takes data-dependent shortcuts in eager (Hugging Face's ``masking_utils`` skips the attention mask
    after ``padding_mask.all()``) takes its traceable path instead. ``adaptdist train`` captures in one.

    Where ``torch.compiler._compile_session_context`` is missing (an older torch), the same flag it sets,
    ``torch.compiler._is_compiling_flag``, is set for the duration."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    return session() if session is not None else _is_compiling_flag_set()


@contextlib.contextmanager
def _is_compiling_flag_set():
    old = getattr(torch.compiler, "_is_compiling_flag", False)
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def opinfo_db() -> list:
    """torch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``), the ops DTensor's
    own op tests sweep: each entry's ``name``, ``variant_test_name``, ``op`` (the callable),
    ``supported_dtypes(device)``, ``supports_autograd`` and ``sample_inputs(device, dtype, requires_grad=...)``.
    Needs the ``expecttest`` package (the ``test`` extras)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def fake_process_group(rank: int, world_size: int) -> None:
    """Initialize the default process group on torch's fake backend
    (``torch.testing._internal.distributed.fake_pg``): collectives return at once without moving data, so
    one process can run DTensor code as rank ``rank`` of ``world_size`` (shapes and placements, not values).
    Destroy it with ``torch.distributed.destroy_process_group()``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# -- torch's elastic launcher ------------------------------------------------------------------------------------
# LaunchConfig and torchrun are public, but the agent's SIGTERM -> SIGKILL grace (``shutdown_timeout``, torchrun's
# ``--shutdown-timeout``) is newer than torch 2.11 (the GPU machine of benchmarks/device_check.sh), whose agent
# waits a fixed 30 s (``PContext.close(death_sig, timeout=30)``).


def elastic_shutdown_timeout_supported() -> bool:
    """Whether this torch's elastic agent takes a shutdown grace (``LaunchConfig.shutdown_timeout``, torchrun's
    ``--shutdown-timeout``); False on torch 2.11, whose agent waits a fixed 30 s before SIGKILL."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return any(f.name == "shutdown_timeout" for f in dataclasses.fields(LaunchConfig))


def elastic_launch_config(shutdown_timeout_s: float, **fields: Any) -> Any:
    """torch's ``LaunchConfig(**fields)`` with the agent's SIGTERM -> SIGKILL grace set to ``shutdown_timeout_s``
    (whole seconds, at least 1) where this torch takes one; where not (torch 2.11) the grace is torch's fixed 30 s."""
    from torch.distributed.launcher.api import LaunchConfig

    if elastic_shutdown_timeout_supported():
        fields["shutdown_timeout"] = int(max(1, round(shutdown_timeout_s)))
    return LaunchConfig(**fields)


def torchrun_shutdown_timeout_args(shutdown_timeout_s: float) -> list[str]:
    """torchrun's flag setting the agent's SIGTERM -> SIGKILL grace to ``shutdown_timeout_s`` (whole seconds, at
    least 1); empty where this torch's torchrun has no such flag (torch 2.11: a fixed 30 s)."""
    if not elastic_shutdown_timeout_supported():
        return []
    return ["--shutdown-timeout", str(int(max(1, round(shutdown_timeout_s))))]


# -- pipeline schedules (issue 15, pp-run): torch.distributed.pipelining's action lists ------------------------------
# The schedule classes are public, but their action lists (``pipeline_order``), the ``_Action`` tuple and the
# send/recv lowering ``_add_send_recv`` are private (torch 2.13: torch/distributed/pipelining/schedules.py).


def _pipelining_stage(stage_index: int, num_stages: int, group_size: int) -> Any:
    """What a schedule's constructor reads of a ``_PipelineStageBase`` to compute its action lists (nothing runs)."""
    import types

    return types.SimpleNamespace(stage_index=stage_index, num_stages=num_stages, group_size=group_size, group_rank=0,
                                 submod=None, is_first=stage_index == 0, is_last=stage_index == num_stages - 1)


def pipelining_compute_order(kind: str, pp_size: int, num_microbatches: int,
                             stages_per_rank: int = 1) -> dict[int, list[tuple[int, str, int]]]:
    """Per pipeline rank, the compute actions ``(stage, "F"|"B"|"I"|"W", microbatch)`` of torch's schedule ``kind``:
    ``"gpipe"`` (``ScheduleGPipe``), ``"interleaved"`` (``ScheduleInterleaved1F1B`` over ``stages_per_rank`` local
    stages, stage ``s`` on rank ``s % pp_size``), ``"zero-bubble"`` (``ScheduleInterleavedZeroBubble``: ZB1P, which on
    one local stage per rank is ZB-H1). Idle slots and REDUCE_GRAD/UNSHARD/RESHARD are dropped.

    Raises:
        ValueError: torch refuses the numbers (its message).
    """
    import torch.distributed.pipelining.schedules as S

    num_stages = pp_size * stages_per_rank
    if kind == "gpipe":
        order = S.ScheduleGPipe(_pipelining_stage(0, num_stages, pp_size), num_microbatches).pipeline_order
    else:
        cls = {"interleaved": S.ScheduleInterleaved1F1B, "zero-bubble": S.ScheduleInterleavedZeroBubble}[kind]
        stages = [_pipelining_stage(i * pp_size, num_stages, pp_size) for i in range(stages_per_rank)]
        with _quiet_logger("torch.distributed.pipelining.schedules"):
            order = cls(stages, num_microbatches).pipeline_order
    keep = {"F", "B", "I", "W"}
    return {rank: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions
                   if a is not None and a.computation_type.value in keep]
            for rank, actions in order.items()}


def pipelining_add_send_recv(compute: dict[int, list[tuple[int, str, int]]],
                             num_stages: int) -> dict[int, list[tuple[int, str, int]]]:
    """``compute`` (per pipeline rank, ``(stage, kind, microbatch)``; stage ``s`` on rank ``s % len(compute)``) with
    torch's SEND_F/RECV_F/SEND_B/RECV_B actions inserted (``_add_send_recv``): each send is placed right after the
    action that computes it and its receive on the peer at the same point of one global order."""
    import torch.distributed.pipelining.schedules as S

    pp_size = len(compute)
    actions = {r: [S._Action(s, S._ComputationType(k), mb) for s, k, mb in acts] for r, acts in compute.items()}
    lowered = S._add_send_recv(actions, stage_to_rank=lambda s: s % pp_size, num_stages=num_stages)
    return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts]
            for r, acts in lowered.items()}


def quiet_fake_tensor_errors():
    """A context in which FakeTensorMode does not log an op that fails on fake tensors ("failed while attempting
    to run meta for aten.mm.default" and its traceback, ~17 lines at ERROR per attempt): a capture reports such a
    failure itself, as one typed error naming the module and the shapes."""
    return _quiet_logger("torch._subclasses.fake_tensor", logging.CRITICAL)


@contextlib.contextmanager
def _quiet_logger(name: str, level_at_least: int = logging.ERROR):
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(max(level_at_least, level))
    try:
        yield
    finally:
        log.setLevel(level)


def stop_rendezvous_heartbeats(timeout_s: float = 5.0) -> int:
    """Stop this process's rendezvous keep-alive timers (torch elastic's ``RendezvousKeepAliveTimer_*`` threads);
    returns how many were running.

    torch's ``launch_agent`` leaves its rendezvous handler open when the agent stops on a signal (to keep the
    rendezvous usable for scaling), so the handler's timer goes on beating against the rendezvous store. Once the
    launcher's store is gone each beat logs a c10d "Failed to recv" warning with a C++ stack, after the launcher's
    own last line. The timer keeps its stop event in the context it passes its thread (torch 2.13's
    ``_PeriodicTimer``); a thread of another shape is left alone."""
    import threading

    stopped = 0
    for t in threading.enumerate():
        if not t.name.startswith("RendezvousKeepAliveTimer_"):
            continue
        ctx = (getattr(t, "_args", None) or (None,))[0]
        stop_event = getattr(ctx, "stop_event", None)
        if stop_event is None:
            continue
        stop_event.set()
        t.join(timeout_s)
        stopped += 1
    return stopped
