"""Single-process eager reference: SGD steps on whole global batches."""

from __future__ import annotations

import copy

import torch


def eager_sgd(model, batches, loss_fn, lr, steps, max_grad_norm=None):
    """Returns per step: (loss, {fqn: grad}), and the final {fqn: param}. With ``max_grad_norm`` the
    gradients are clipped (torch.nn.utils.clip_grad_norm_) before they are recorded and applied."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        history.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history, {n: p.detach().clone() for n, p in model.named_parameters()}
