"""Worker functions for the torch.compile backend's multi-process tests (importable by spawned ranks).

Each rank runs the user's ordinary loop: the model compiled with the adaptdist backend, an SGD
optimizer over ``model.parameters()``, its own rows of each global batch (the DDP input contract),
``loss.backward()``, ``opt.step()``. It records its loss, the full gradient of every parameter
and, at the end, ``adaptdist.full_state_dict``.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import adaptdist
import adaptdist.models.gpt as gpt_module
from adaptdist.annotations import ManualPlan
from models import hf_llama, mlp, self_attention, tiny_gpt, transformer_encoder

def hf_gpt2(batch: int, seq_len: int = 8, seed: int = 0):
    """A Hugging Face GPT-2 built from a small config (random weights, no download), in eval mode (no
    dropout); the loss is next-token cross entropy on its logits."""
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, 97, (batch, seq_len), generator=g)
    y = torch.randint(0, 97, (batch, seq_len), generator=g)
    return model, (x, y), lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten())


class _PaddedBert(torch.nn.Module):
    """BERT whose attention mask comes from padding (id 0): its mask path indexes the mask by batch position."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        self.bert = BertForMaskedLM(BertConfig(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))

    def forward(self, ids):
        return self.bert(input_ids=ids, attention_mask=(ids != 0).long()).logits


def hf_bert(batch: int, seq_len: int = 8, seed: int = 0):
    """A Hugging Face BERT from a small config (random weights, no download) on padded rows."""
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = _PaddedBert()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(1, 31, (batch, seq_len), generator=g)
    for r in range(batch):
        x[r, seq_len - r % 4:] = 0  # rows padded by 0..3 tokens
    y = torch.randint(0, 31, (batch, seq_len), generator=g)
    return model, (x, y), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())


class ScalarLoss(torch.nn.Module):
    """Returns its own scalar loss, with Python scalars in the arithmetic (Dynamo lifts them to tensors)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.sqrt((y * y).sum() + 1e-3) * 0.1 + 0.5


def scalar_loss(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    model = ScalarLoss()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 8, generator=g), torch.zeros(batch)), lambda out, _: out


FACTORIES = {
    "gpt": lambda batch: tiny_gpt(batch, 8, seed=0, num_heads=4, num_layers=1),  # one block: less to compile, and depth is nothing these checks look at
    "mlp": lambda batch: mlp(batch, seed=0),
    "hf_gpt2": hf_gpt2,
    "scalar_loss": scalar_loss,
    "hf_bert": hf_bert,
    "hf_llama": lambda batch: hf_llama(batch, 8),
    # nn.MultiheadAttention(batch_first=True) merges [T, B, D] into rows, the batch inside (batch_inner_merges)
    "encoder": lambda batch: transformer_encoder(batch, 5, d_model=16),
    "mha": lambda batch: self_attention(batch, 5, d_model=16),
}


SEEDED = {  # the same models, built from another seed: each rank's own initial weights
    "gpt": lambda batch, seed: tiny_gpt(batch, 8, seed=seed, num_heads=4, num_layers=1)[0],
    "mlp": lambda batch, seed: mlp(batch, seed=seed)[0],
}


def make_plan(model: str, plan: str):
    """A plan argument for adaptdist.backend: the GPT's tp presets as ManualPlan.parse gives them; other models'
    as the string, which the backend resolves from the compiled module (a Hugging Face model's own plan)."""
    if plan in ("tp", "dp,tp") and model == "gpt":
        return ManualPlan.parse(plan, gpt_module)
    return plan


def rank_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def _join_group(timeout_s: float) -> bool:
    """Start this rank's gloo process group unless :func:`suite_worker` already did; True if this call started
    it (then the caller destroys it)."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return True


def _leave_group(owned: bool) -> None:
    if owned:
        dist.destroy_process_group()


def suite_worker(parts: list[tuple[str, str, tuple]], timeout_s: float = 180.0) -> dict:
    """Several of this module's workers in one launch (one process group, started once): ``parts`` is
    [(key, worker name, args)]; returns {key: ("ok", result) or ("error", traceback)}. Dynamo's caches are
    reset before each part, so each compiles as in a fresh process (no automatic dynamic shapes carried
    over from an earlier part's model). A part that fails is recorded and the next one runs; put
    ``teardown_worker`` last (it destroys the group)."""
    import traceback

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    out: dict = {}
    try:
        for key, name, args in parts:
            torch._dynamo.reset()
            try:
                out[key] = ("ok", globals()[name](*args))
            except Exception:
                out[key] = ("error", traceback.format_exc())
        return out
    finally:
        _leave_group(owned and dist.is_initialized())


class _BreakAfterFirst(torch.nn.Module):
    """``model`` with a graph break before it (a logging call in Hugging Face's GPT-2 does the same)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.model(x)


def mismatch_worker(timeout_s: float = 60.0, graph_break: bool = False) -> str:
    """Rank 1 passes inputs of another shape than rank 0: every rank must refuse with the same error (with
    ``graph_break``, after a graph break in the model)."""
    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank = int(os.environ["RANK"])
        model, (x, y), loss_fn = mlp(6, seed=0)
        if graph_break:
            model = _BreakAfterFirst(model)
        compiled = torch.compile(model, backend=adaptdist.backend(plan="dp"), fullgraph=not graph_break)
        try:
            loss_fn(compiled(x[:2] if rank == 0 else x[:3]), y[:2] if rank == 0 else y[:3]).backward()
        except Exception as e:  # Dynamo wraps the backend's error
            return f"{type(e).__name__}: {e}"
        return "no error"
    finally:
        _leave_group(owned)


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The full gradient of ``p``, all_gathered where the backend sharded the parameter."""
    layout = getattr(p, "_adaptdist_layout", None)
    return p.grad.clone() if layout is None else layout.gather(p.grad)


def sharded_memory_worker(plan: str, timeout_s: float = 120.0) -> dict:
    """GPT with AdamW (built before torch.compile) through the backend under ``plan``: this rank's parameter
    and optimizer-state element counts, and the peak-memory metric (adaptdist.runtime.memory) of the second
    step's compiled programs, with the parameters, optimizer state, batch and saved activations counted as
    live. (The meter is a TorchDispatchMode, under which Dynamo does not run compiled code, so it is put
    around the programs, inside the compiled call.)"""
    from adaptdist.runtime.memory import PeakMemory

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model, batch, loss_fn = FACTORIES["gpt"](8)  # the model the test counts against
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        be = adaptdist.backend(plan=plan)
        compiled = torch.compile(model, backend=be, fullgraph=True)
        x, y = (rank_rows(t, rank, world) for t in batch)
        for measure in (False, True):
            if measure:
                step, peaks = be.compiled[0], []
                live = [list(model.parameters()), [v for s in opt.state.values() for v in s.values()], x, y]
                run_forward, run_backward = step.run_forward, step.run_backward

                def metered_forward(args):
                    with PeakMemory(existing=live) as pm:
                        out = run_forward(args)
                    peaks.append(pm.report.peak_bytes)
                    return out

                def metered_backward(program_inputs, saved, grads, outputs):
                    with PeakMemory(existing=live + [program_inputs, saved, list(grads)]) as pm:
                        out = run_backward(program_inputs, saved, grads, outputs)
                    peaks.append(pm.report.peak_bytes)
                    return out

                step.run_forward, step.run_backward = metered_forward, metered_backward
            loss_fn(compiled(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"param_numel": sum(p.numel() for p in model.parameters()),
                "state_numel": sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0),
                "peak_bytes": max(peaks), "full": {k: v.shape for k, v in adaptdist.full_state_dict(compiled).items()}}
    finally:
        _leave_group(owned)


def backend_sgd_worker(cases: list[dict], steps: int, lr: float, timeout_s: float = 120.0) -> list[dict]:
    """Run each case (model, plan, mesh, global batch size) for ``steps`` SGD steps through
    ``torch.compile(model, backend=adaptdist.backend(...))``; one process group for all cases."""
    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        out = []
        for case in cases:
            model, batch, loss_fn = FACTORIES[case["model"]](case["batch"])
            if case.get("rank_seeded"):  # rank r builds its model from seed r (rank 0's are eager's weights)
                model.load_state_dict(SEEDED[case["model"]](case["batch"], rank).state_dict())
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            be = adaptdist.backend(plan=make_plan(case["model"], case["plan"]), mesh=case.get("mesh"),
                                   comm=case.get("comm", "auto"))
            compiled = torch.compile(model, backend=be, fullgraph=True)
            losses, grads = [], []
            for _ in range(steps):
                x, y = (rank_rows(t, rank, world) for t in batch)
                loss = loss_fn(compiled(x), y)
                loss.backward()
                if case.get("clip"):
                    adaptdist.clip_grad_norm_(model, case["clip"])
                losses.append(loss.item())
                grads.append({n: full_grad(p) for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
            with torch.no_grad():  # an eval pass after training: the sharded model through the same graph
                eval_out = compiled(rank_rows(batch[0], rank, world))
            out.append({"losses": losses, "grads": grads, "params": adaptdist.full_state_dict(compiled),
                        "eval_out": eval_out,
                        "meshes": [s.mesh for s in be.compiled],
                        "local_numel": sum(p.numel() for p in model.parameters()),
                        "collectives": [s.collectives() for s in be.compiled]})
        return out
    finally:
        _leave_group(owned)


def interleaved_meshes_worker(steps: int, lr: float, timeout_s: float = 120.0, comm: str = "auto") -> list[dict]:
    """Two models compiled on different meshes (GPT on dp=2 x tp=2, the MLP on dp=4: both name a ``dp``
    axis, of different groups), their forwards and backwards interleaved; each model's losses and grads, its
    SGD-updated parameters and its graphs' collectives."""
    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        runs, backends = [], []
        for name, plan, mesh in (("gpt", "dp,tp", "dp=2,tp=2"), ("mlp", "dp", None)):
            model, batch, loss_fn = FACTORIES[name](4)
            be = adaptdist.backend(plan=make_plan(name, plan), mesh=mesh, comm=comm)
            backends.append(be)
            compiled = torch.compile(model, backend=be)
            runs.append((model, compiled, [rank_rows(t, rank, world) for t in batch], loss_fn,
                         torch.optim.SGD(model.parameters(), lr=lr)))
        out = [{"losses": [], "grads": []} for _ in runs]
        for _ in range(steps):
            losses = [loss_fn(compiled(x), y) for _, compiled, (x, y), loss_fn, _ in runs]  # both forwards first
            for k in reversed(range(len(runs))):
                losses[k].backward()
            for k, (model, _, _, _, opt) in enumerate(runs):
                out[k]["losses"].append(losses[k].item())
                out[k]["grads"].append({n: full_grad(p) for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
        for k, ((_, compiled, _, _, _), be) in enumerate(zip(runs, backends)):
            out[k]["params"] = adaptdist.full_state_dict(compiled)
            out[k]["collectives"] = [s.collectives() for s in be.compiled]
        return out
    finally:
        _leave_group(owned)


def sharded_usage_worker(timeout_s: float = 120.0) -> dict:
    """What a training loop does around a model whose parameters the backend sharded (MLP, fsdp, 2 ranks):
    gradient accumulation over micro-batches of two shapes (dynamic=False: a re-trace while the shards hold
    gradients), zero_grad(set_to_none=False) then an eval pass, state_dict()/load_state_dict, and a direct
    call of the original module."""
    import warnings

    from adaptdist.runtime.sharded_params import ShardedStateWarning

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model, (x, y), loss_fn = mlp(12, seed=0)
        compiled = torch.compile(model, backend=adaptdist.backend(plan="fsdp"), dynamic=False)
        out: dict = {}
        for rows in ((0, 8), (8, 12)):  # micro-batches of 4 and 2 rows per rank, gradients accumulated
            xm, ym = (rank_rows(t[rows[0]:rows[1]], rank, world) for t in (x, y))
            loss_fn(compiled(xm), ym).backward()
        out["grads"] = {n: full_grad(p) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=False)
        with torch.no_grad():
            out["eval"] = compiled(rank_rows(x, rank, world))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = model.state_dict()
        out["state_dict_warned"] = any(issubclass(w.category, ShardedStateWarning) for w in caught)
        out["state_dict_shapes"] = {k: tuple(v.shape) for k, v in sd.items()}
        reference, _, _ = mlp(12, seed=5)
        model.load_state_dict(reference.state_dict())  # full tensors: each rank keeps its shard
        with torch.no_grad():
            out["after_load"] = compiled(rank_rows(x, rank, world))
        out["loaded_full"] = adaptdist.full_state_dict(compiled)
        try:
            model(x)
            out["direct_call"] = "no error"
        except Exception as e:
            out["direct_call"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        _leave_group(owned)


def sequential_mlp(seed: int = 0) -> torch.nn.Sequential:
    """A top-level nn.Sequential (Dynamo compiles a torch.nn module through its wrap_inline frame)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def sequential_worker(steps: int, lr: float, timeout_s: float = 120.0) -> dict:
    """A top-level nn.Sequential under fsdp (its parameters sharded) on 2 ranks: ``steps`` SGD steps on 4 rows
    per rank, an eval pass under no_grad (a re-trace), a training step at 6 rows per rank (a re-trace at a new
    batch size), state_dict() (warns that it holds shards), load_state_dict of full tensors; the adaptdist
    log lines of the run."""
    import warnings

    from adaptdist.compiler.dynamo_backend import GraphBreakWarning
    from adaptdist.runtime.sharded_params import ShardedStateWarning

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    records = _Records()
    logger = logging.getLogger("adaptdist")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        rank, world = int(os.environ["RANK"]), dist.get_world_size()
        model = sequential_mlp()
        _, (x, y), loss_fn = mlp(12, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        compiled = torch.compile(model, backend=adaptdist.backend(plan="fsdp"), dynamic=False)
        out: dict = {"losses": [], "grads": []}
        caught = warnings.catch_warnings(record=True)  # the graph-break warnings of the whole run
        breaks = caught.__enter__()
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = loss_fn(compiled(rank_rows(x[:8], rank, world)), rank_rows(y[:8], rank, world))
            loss.backward()
            out["losses"].append(loss.item())
            out["grads"].append({n: full_grad(p) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        out["local_numel"] = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            out["eval"] = compiled(rank_rows(x[:8], rank, world))
        loss = loss_fn(compiled(rank_rows(x, rank, world)), rank_rows(y, rank, world))  # 6 rows per rank
        loss.backward()
        out["wide_loss"] = loss.item()
        out["wide_grads"] = {n: full_grad(p) for n, p in model.named_parameters()}
        opt.zero_grad()
        out["params"] = adaptdist.full_state_dict(compiled)
        caught.__exit__(None, None, None)
        out["graph_breaks"] = [str(w.message) for w in breaks if issubclass(w.category, GraphBreakWarning)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.state_dict()
        out["state_dict_warned"] = any(issubclass(w.category, ShardedStateWarning) for w in caught)
        model.load_state_dict(sequential_mlp(seed=5).state_dict())  # full tensors: each rank keeps its shard
        with torch.no_grad():
            out["after_load"] = compiled(rank_rows(x[:8], rank, world))
        out["log"] = records.lines
        try:
            model(x)
            out["direct_call"] = "no error"
        except Exception as e:
            out["direct_call"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        logger.removeHandler(records)
        _leave_group(owned)


def teardown_worker(timeout_s: float = 120.0) -> list[str]:
    """A training step through the backend (fsdp), then destroy_process_group(): the names of this process's
    threads left (/proc/self/task). torch.compile first runs after init_process_group here, as in a script."""
    torch.set_num_threads(1)
    _join_group(timeout_s)
    rank, world = int(os.environ["RANK"]), dist.get_world_size()
    model, (x, y), loss_fn = mlp(4, seed=0)
    compiled = torch.compile(model, backend=adaptdist.backend(plan="fsdp"), dynamic=False)
    loss_fn(compiled(rank_rows(x, rank, world)), rank_rows(y, rank, world)).backward()
    adaptdist.full_state_dict(compiled)
    dist.destroy_process_group()
    import gc

    gc.collect()
    tasks = sorted(os.listdir("/proc/self/task"))
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]


def hf_causal_lm(name: str, seed: int = 0) -> torch.nn.Module:
    """A small Hugging Face causal LM from a config (random weights, no download, no dropout): ``llama``
    (RMSNorm weights, a forward under decorators: Dynamo's frame is the decorator's) or ``gpt2`` (its loss
    computed in a second graph after a break)."""
    import transformers as tr

    torch.manual_seed(seed)
    if name == "llama":
        cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    else:
        cfg = tr.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    return tr.AutoModelForCausalLM.from_config(cfg)


def hf_retrace_batch() -> torch.Tensor:
    """The global batch of :func:`hf_retrace_worker`: 8 rows of 6 token ids (labels are the ids)."""
    return torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))


def hf_retrace_worker(name: str, plan: str, lr: float, timeout_s: float = 180.0) -> dict:
    """A Hugging Face causal LM (:func:`hf_causal_lm`) through the backend under ``plan`` on 2 ranks, with
    labels (the model computes its loss): an SGD step on 4 rows per rank, an evaluation under no_grad (a
    re-trace), an SGD step on 2 rows per rank (a re-trace at a new shape). Records each loss, the full
    gradients of both steps and the final full state dict."""
    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    try:
        rank = int(os.environ["RANK"])
        model = hf_causal_lm(name)
        x = hf_retrace_batch()
        compiled = torch.compile(model, backend=adaptdist.backend(plan=plan), dynamic=False)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        out: dict = {"loss": [], "grads": []}
        for rows in (x[4 * rank:4 * rank + 4], x[4 * rank:4 * rank + 2]):
            loss = compiled(input_ids=rows, labels=rows).loss
            loss.backward()
            out["loss"].append(loss.item())
            out["grads"].append({n: full_grad(p) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            if "eval" not in out:
                with torch.no_grad():
                    out["eval"] = compiled(input_ids=rows, labels=rows).loss.item()
        out["state"] = adaptdist.full_state_dict(compiled)
        return out
    finally:
        _leave_group(owned)


class _BranchOnData(torch.nn.Module):
    """A data-dependent ``if`` between two layers (a graph break, then one resume function per side)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        if x.mean() > 0:
            h = h * 2
        else:
            h = h - 1
        return self.out(h)


def divergence_worker(timeout_s: float = 60.0) -> dict:
    """Ranks that agree at step 0 and diverge at step 1, two ways, in one process group (the first error leaves
    every rank at the same point, so the second case runs after it):

    - ``branch``: the ranks take the same side of a branch on data at step 0, different sides at step 1 (rank 1
      compiles the other side's resume function alone);
    - ``shape``: rank 1's batch at step 1 has 3 rows instead of 4 (Dynamo recompiles on rank 1 only).

    Per case: the error each rank stopped with (type and text, or "no error"), the steps it completed and the
    seconds from the divergent step's start to the error."""
    import time

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    rank = dist.get_rank()
    out = {}
    try:
        for case in ("branch", "shape"):
            torch._dynamo.reset()
            model = _BranchOnData() if case == "branch" else mlp(4, seed=0)[0]
            compiled = torch.compile(model, backend=adaptdist.backend(plan="dp"), dynamic=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            done, error, t0 = 0, "no error", 0.0
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                if case == "branch":
                    x = torch.randn(4, 16, generator=g) + (1.0 if step == 0 or rank == 0 else -1.0)
                    y = torch.randint(0, 3, (4,), generator=g)
                else:
                    rows = 3 if step == 1 and rank == 1 else 4
                    x, y = torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)
                t0 = time.perf_counter()
                try:
                    torch.nn.functional.cross_entropy(compiled(x), y).backward()
                except Exception as e:  # Dynamo wraps the backend's error on the rank that compiles
                    error = f"{type(e).__name__}: {e}"
                    break
                opt.step()
                opt.zero_grad()
                done += 1
            out[case] = (error, done, time.perf_counter() - t0)
        return out
    finally:
        _leave_group(owned)


def wrong_shape_worker(timeout_s: float = 60.0) -> dict:
    """Rank 1 calls the compiled model with an input the model cannot take (a feature dim of another size), so
    Dynamo's trace fails on rank 1 only, while rank 0 compiles or runs the graph (issue 14). Cases, in one process
    group (each error leaves every rank at the same point, so the next case runs after it):

    - ``mlp_step0``: an MLP (12 features), rank 1's batch with 11 features at the first step (rank 0 compiles);
    - ``mlp_step1``: the same at the second step (rank 0 runs the compiled graph, and meets rank 1 at its backward);
    - ``hf_gpt2``: Hugging Face GPT-2 from a config (width 32) called with ``inputs_embeds``, rank 1's 31 wide.

    Per case: the error each rank stopped with (type and text, or "no error"), the steps it completed and the
    seconds from the failing step's start to the error."""
    import time

    torch.set_num_threads(1)
    owned = _join_group(timeout_s)
    rank = dist.get_rank()
    out = {}
    try:
        import importlib.util

        cases = ("mlp_step0", "mlp_step1") + (("hf_gpt2",) if importlib.util.find_spec("transformers") else ())
        for case in cases:
            torch._dynamo.reset()
            if case == "hf_gpt2":
                from transformers import GPT2Config, GPT2LMHeadModel

                torch.manual_seed(0)
                model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=31, n_positions=16)).eval()
            else:
                model = mlp(4, seed=0)[0]
            compiled = torch.compile(model, backend=adaptdist.backend(plan="dp"), dynamic=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            done, error, t0 = 0, "no error", 0.0
            for step in range(2):
                g = torch.Generator().manual_seed(10 * step + rank)
                wrong = rank == 1 and step == (1 if case == "mlp_step1" else 0)
                t0 = time.perf_counter()
                try:
                    if case == "hf_gpt2":
                        embeds = torch.randn(4, 6, 31 if wrong else 32, generator=g)
                        loss = compiled(inputs_embeds=embeds).logits.float().pow(2).mean()
                    else:
                        x, y = torch.randn(4, 11 if wrong else 12, generator=g), torch.randint(0, 5, (4,), generator=g)
                        loss = torch.nn.functional.cross_entropy(compiled(x), y)
                    loss.backward()
                except Exception as e:  # the typed error itself (compat.through_dynamo)
                    error = f"{type(e).__name__}: {e}"
                    break
                opt.step()
                opt.zero_grad()
                done += 1
            out[case] = (error, done, time.perf_counter() - t0)
        return out
    finally:
        _leave_group(owned)
