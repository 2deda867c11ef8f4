"""The executor posts sends and receives and waits only where it must (one process, a scripted peer instead of gloo):
a receive blocks only the compute action that uses its values, sends are waited for at the step's end; the last
stage's loss and the gradients it sends equal autograd's."""

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
