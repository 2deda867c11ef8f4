"""The executor posts sends and receives and waits only where it must (one process, a scripted peer instead of gloo):
a receive blocks only the compute action that uses its values, sends are waited for at the step's end; the last
stage's loss and the gradients it sends equal autograd's; and those semantics, simulated on every schedule's lists,
let every rank finish."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from adaptdist.errors import CollectiveTimeoutError
from adaptdist.runtime import pipeline_executor
from adaptdist.runtime.pipeline_executor import PipelineStepRunner
from adaptdist.runtime.worker import make_optimizer
from pipeline_workers import D, build_programs

M, ROWS = 4, 8


class _Done:
    def __init__(self, log=None, event=None):
        self.log, self.event = log, event

    def wait(self, timeout=None):
        if self.log is not None:
            self.log.append(self.event)
        return True


class _ScriptedPeer:
    """Rank 0 of a 2-rank pipeline, as ``torch.distributed`` seen from rank 1 (the last stage): it sends microbatch
    ``i``'s activations only once it has microbatch ``i - 1``'s gradient (stricter than 1F1B's rank 0, which runs
    two forwards ahead), and a receive of activations it cannot send yet fails like a gloo timeout."""

    ReduceOp = dist.ReduceOp

    def __init__(self, activations: torch.Tensor):
        self.activations = activations.chunk(M)
        self.grads: dict[int, torch.Tensor] = {}
        self.log: list[tuple[str, int]] = []

    @staticmethod
    def _mb(tag: int) -> int:
        return tag // 64 % M

    def get_world_size(self) -> int:
        return 2

    def isend(self, t, dst, tag):
        assert dst == 0 and tag // 64 // M == 2 * 1 + 1, tag  # stage 1's backward
        self.log.append(("post send", self._mb(tag)))
        self.grads[self._mb(tag)] = t.clone()
        return _Done(self.log, ("wait send", self._mb(tag)))

    def irecv(self, buf, src, tag):
        assert src == 0 and tag // 64 // M == 2 * 0, tag  # stage 0's forward
        mb = self._mb(tag)
        self.log.append(("post recv", mb))
        peer = self

        class _Recv:
            def wait(self, timeout=None):
                peer.log.append(("wait recv", mb))
                if mb > 0 and mb - 1 not in peer.grads:
                    raise RuntimeError(f"Timed out waiting {timeout} for recv operation to complete")
                buf.copy_(peer.activations[mb])
                return True

        return _Recv()

    def all_reduce(self, t, op=None, group=None, async_op=False):
        return _Done()  # the world's loss all-reduce: rank 0 contributes 0


def _last_stage(monkeypatch, cls=PipelineStepRunner):
    program = build_programs(2, 1, "1f1b", M, ROWS, tied=False)[1]
    g = torch.Generator().manual_seed(3)
    acts, target = torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)
    peer = _ScriptedPeer(acts)
    monkeypatch.setattr(pipeline_executor, "dist", peer)
    runner = cls(program, "sgd", 0.0, {(): None}, timeout_s=5.0, make_optimizer=make_optimizer)
    return runner, peer, acts, target


def test_a_receive_blocks_only_the_compute_that_uses_it(monkeypatch):
    runner, peer, acts, target = _last_stage(monkeypatch)
    w, b = (runner.state[f].clone() for f in runner.program.param_fqns[::-1])  # layers.1.weight, layers.1.bias
    loss = runner.step((torch.zeros(ROWS, D), target))
    # rank 1's list receives microbatch i + 1's activations before B(i); posted, it runs B(i) and sends first
    assert peer.log.index(("post recv", 1)) < peer.log.index(("post send", 0)) < peer.log.index(("wait recv", 1))
    last_post = max(i for i, e in enumerate(peer.log) if e[0] == "post send")
    assert all(i > last_post for i, e in enumerate(peer.log) if e[0] == "wait send"), peer.log
    assert sorted(e[1] for e in peer.log if e[0] == "wait send") == list(range(M))
    a = acts.clone().requires_grad_(True)
    ref = ((torch.tanh(a @ w.T + b) - target) ** 2).mean()
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(torch.cat([peer.grads[i] for i in range(M)]), a.grad, atol=1e-6, rtol=1e-5)


class _BlockingReceives(PipelineStepRunner):
    """Each receive waited for at its place in the list (the executor before posted receives)."""

    def _post_recvs(self, specs, routes, peer, a, backward, stage):
        return self._take({0: super()._post_recvs(specs, routes, peer, a, backward, stage)}, 0)


def test_receives_waited_at_their_place_in_the_list_would_stall_on_that_peer(monkeypatch):
    """The control: the same peer stalls an executor that waits for each receive where the list has it."""
    runner, _, _, target = _last_stage(monkeypatch, _BlockingReceives)
    with pytest.raises(CollectiveTimeoutError, match=r"receive 1RECV_F1 .*with rank 0"):
        runner.step((torch.zeros(ROWS, D), target))


def _run_posted(order: dict, pp: int) -> tuple[dict, set]:
    """Every rank's list under the executor's semantics: sends and receives are posted and never block; a compute
    action blocks until the message it uses was posted by both ends; at the end each send waits for its receive.
    Returns each rank's position when nothing can move (its list's length when it finished) and the sends whose
    receive was never posted."""
    from adaptdist.pipeline_schedules import stage_rank

    posted: set[tuple] = set()  # (kind, stage, microbatch) of every posted send and receive, all ranks
    pos = {r: 0 for r in order}

    def needs(a) -> list[tuple]:
        """The (send, receive) pair compute action ``a`` waits for, if its input comes from another rank."""
        if a.kind == "F" and a.stage > 0 and stage_rank(a.stage - 1, pp) != stage_rank(a.stage, pp):
            return [("SEND_F", a.stage - 1, a.microbatch), ("RECV_F", a.stage, a.microbatch)]
        if a.kind in ("B", "I") and ("RECV_B", a.stage, a.microbatch) in wanted:
            return [("SEND_B", a.stage + 1, a.microbatch), ("RECV_B", a.stage, a.microbatch)]
        return []

    wanted = {(a.kind, a.stage, a.microbatch) for acts in order.values() for a in acts if a.kind == "RECV_B"}
    moved = True
    while moved:
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                    posted.add((a.kind, a.stage, a.microbatch))
                elif not all(n in posted for n in needs(a)):
                    break
                pos[r] += 1
                moved = True
    sends = {(k, s, mb) for acts in order.values() for a in acts for k, s, mb in [(a.kind, a.stage, a.microbatch)]
             if k.startswith("SEND")}
    unmatched = {(k, s, mb) for k, s, mb in sends  # the step's end: every send waits for its receive
                 if (k.replace("SEND", "RECV"), s + (1 if k == "SEND_F" else -1), mb) not in posted}
    return pos, unmatched


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8)])
def test_every_schedule_finishes_with_posted_sends_and_receives(schedule, pp, m):
    """The executor's semantics (posted, waited at use and at the end) on every schedule's lists: every rank
    reaches the end of its list (the module docstring's argument, checked)."""
    from adaptdist.pipeline_schedules import pipeline_order, stages_per_rank

    order = pipeline_order(schedule, pp, m, stages_per_rank(schedule))
    pos, unmatched = _run_posted(order, pp)
    assert all(pos[r] == len(order[r]) for r in order), {r: (pos[r], len(order[r])) for r in order}
    assert not unmatched


def test_a_receive_placed_after_its_use_is_caught():
    """The control: a list whose receive comes after the forward that needs it does not finish."""
    from adaptdist.pipeline_schedules import pipeline_order

    order = pipeline_order("1f1b", 2, 2, 1)
    acts = list(order[1])
    i = next(k for k, a in enumerate(acts) if a.kind == "RECV_F")
    acts[i], acts[i + 1] = acts[i + 1], acts[i]  # 1F0 before 1RECV_F0
    pos, unmatched = _run_posted({0: order[0], 1: acts}, 2)
    assert pos[1] == i < len(acts) and unmatched
