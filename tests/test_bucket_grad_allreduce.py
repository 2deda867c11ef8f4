import torch

from adaptdist.lowering_options import LoweringOptions
from adaptdist.compiler.lowering import compile_model
from adaptdist.passes.bucket_grad_allreduce import plan_buckets
from models import tiny_gpt
from passutil import simulate
from reference import eager_sgd


def _grad_all_reduces(prog):
    return [c for c in prog.collectives() if "all_reduce" in c]


def test_bucket_size_controls_the_number_of_all_reduces():
    model, batch, loss_fn = tiny_gpt(4, 8)
    n_params = len(list(model.parameters()))
    small = compile_model(model, batch, loss_fn, 2, options=LoweringOptions(grad_bucket_bytes=1))
    big = compile_model(model, batch, loss_fn, 2, options=LoweringOptions(grad_bucket_bytes=2**30))
    # loss and nll total weight take 2 all_reduces; the rest are gradient buckets
    assert len(_grad_all_reduces(small[0])) == 2 + n_params  # one per gradient (parameters() counts a tied pair once)
    assert len(_grad_all_reduces(big[0])) == 2 + 1
    total = sum(p.numel() for p in model.parameters())
    assert int(_grad_all_reduces(big[0])[-1].split(", ")[-1].rstrip(")")) == total


def test_bucketed_gradients_equal_eager():
    model, batch, loss_fn = tiny_gpt(5, 8)
    progs, outs = simulate(model, batch, loss_fn, 2, options=LoweringOptions(grad_bucket_bytes=4096))
    hist, _ = eager_sgd(model, [batch], loss_fn, 0.1, 1)
    p = progs[0]
    for r in range(2):
        for f in p.param_fqns:
            torch.testing.assert_close(outs[r][p.output_roles.index(f"grad:{f}")], hist[0][1][f], atol=1e-5, rtol=1e-5)


def test_plan_buckets_keeps_order_and_limit():
    import torch.fx

    g = torch.fx.Graph()
    nodes = []
    for n in (10, 10, 30, 5):
        x = g.placeholder(f"g{n}_{len(nodes)}")
        x.meta["val"] = torch.empty(n)
        nodes.append(x)
    buckets = plan_buckets(nodes, bucket_bytes=80)
    assert [[b.meta["val"].numel() for b in bk] for bk in buckets] == [[10, 10], [30], [5]]
