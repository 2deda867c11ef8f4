# Rerun of the MobileViT dp-vs-eager finding in float32 and float64 (see notes/mobilevit_float64.md).
# Run from the worktree root: PYTHONPATH=$PWD python notes/mobilevit_float64_check.py sync
import sys, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, "tests")
from transformers import MobileViTConfig, MobileViTForImageClassification
from passutil import simulated_sgd
from reference import eager_sgd

class Wrap(nn.Module):
    def __init__(self, m): super().__init__(); self.m = m
    def forward(self, x): return self.m(pixel_values=x).logits

def run(dtype, bn):
    torch.manual_seed(0)
    cfg = MobileViTConfig(image_size=32, patch_size=2, num_channels=3, hidden_sizes=[16, 24, 32],
                          neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2, num_labels=3,
                          expand_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0)
    model = Wrap(MobileViTForImageClassification(cfg)).to(dtype)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 3, (4,), generator=g))
    want_hist, want_params = eager_sgd(model, [batch], F.cross_entropy, 0.1, 1)
    progs, hist, params, bufs = simulated_sgd(model, batch, F.cross_entropy, 2, "dp", 0.1, 1, batch_norm=bn)
    (loss, grads), (wl, wg) = hist[0], want_hist[0]
    worst = max(((grads[f] - wg[f]).abs().max().item(), f) for f in wg)
    bnw = max(((grads[f] - wg[f]).abs().max().item(), f) for f in wg if "normalization" in f or "norm" in f)
    rel = max(((grads[f] - wg[f]).abs().max().item() / (wg[f].abs().max().item() + 1e-30), f) for f in wg)
    print(dtype, bn, "loss diff", abs(loss - wl), "worst grad", worst, "worst norm-grad", bnw, "worst rel", rel, flush=True)

for dtype in (torch.float32, torch.float64):
    run(dtype, sys.argv[1] if len(sys.argv) > 1 else "sync")
