"""Local training and evaluation of a classifier on a client's (x, y) tensors; shared by the image methods."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]


LossFn = Callable[[Params, Params, torch.Tensor, torch.Tensor], torch.Tensor]


def _sgd_update(
    theta: Params,
    names: list[str],
    grads: dict[str, torch.Tensor],
    velocity: Params,
    *,
    lr: float,
    momentum: float,
    rows: slice | torch.Tensor | None = None,
) -> None:
    """theta[n] -= lr * step in place, step = grad or the heavy-ball velocity (rows: the clients that stepped)."""
    for n in names:
        g = grads[n]
        if momentum:
            v = velocity[n] if rows is None else velocity[n][rows]
            v = v.mul(momentum).add_(g)
            if rows is None:
                velocity[n] = v
            else:
                velocity[n][rows] = v
            g = v
        if rows is None:
            theta[n] = theta[n] - lr * g
        else:
            theta[n][rows] -= lr * g


def functional_sgd(
    loss_fn: LossFn,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    trainable: Collection[str],
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    aux: Params | None = None,
    momentum: float = 0.0,
    project: Callable[[Params], Params] | None = None,
) -> tuple[Params, float]:
    """``epochs`` passes of minibatch SGD on ``loss_fn(params, aux, x_batch, y_batch)`` over the names in
    ``trainable`` (the others stay fixed), each pass in an order drawn from ``generator``; the last batch of a
    pass may be smaller. ``aux`` holds fixed per-client tensors the loss reads (a prox anchor, class counts).
    Momentum (heavy ball, as ``torch.optim.SGD``) restarts from zero at every call. ``project`` (projected SGD):
    after every step, ``theta`` is updated with ``project(theta)`` (e.g. APFL's mixing weight clipped to
    [0, 1]). Returns new tensors (the inputs are not modified) and the mean training loss over records."""
    if len(x) == 0:
        raise ValueError("local training got no records.")
    unknown = set(trainable) - set(params)
    if unknown:
        raise ValueError(f"trainable names not among the parameters: {sorted(unknown)[:5]}.")
    names = [n for n in params if n in set(trainable)]
    theta = {n: t.detach().clone() for n, t in params.items()}
    aux = aux or {}
    velocity = {n: torch.zeros_like(theta[n]) for n in names}
    total, count = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator, device=generator.device).to(x.device)
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            live = {n: theta[n].requires_grad_(True) for n in names}
            loss = loss_fn({**theta, **live}, aux, x[idx], y[idx])
            grads = dict(zip(names, torch.autograd.grad(loss, [live[n] for n in names]))) if names else {}
            with torch.no_grad():
                theta.update({n: live[n].detach() for n in names})
                _sgd_update(theta, names, grads, velocity, lr=lr, momentum=momentum)
                if project is not None:
                    theta.update(project(theta))
            total += float(loss.detach()) * len(idx)
            count += len(idx)
    return theta, total / count


def batched_sgd(
    loss_fn: LossFn,
    params: Params,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    trainable: Collection[str],
    epochs: int,
    batch_size: int,
    lr: float,
    generators: list[torch.Generator],
    aux: Params | None = None,
    momentum: float = 0.0,
    project: Callable[[Params], Params] | None = None,
) -> tuple[Params, list[float]]:
    """:func:`functional_sgd` of ``C`` clients at once: ``params`` and ``aux`` are stacked along a leading client
    axis, client ``c`` has records ``(xs[c], ys[c])`` and batch order from ``generators[c]`` (so each client sees
    exactly the batches of its own :func:`functional_sgd` run). Full batches of every client still running are
    one ``torch.func.vmap``-ed gradient step (clients sorted by their number of full batches, so the running
    ones are a prefix of the stack: views, no copies); each client's smaller last batch is stepped afterwards,
    clients with the same remainder together. Results agree with the per-client path to float rounding."""
    from torch.func import grad_and_value, vmap

    count_c = len(xs)
    if not (len(ys) == len(generators) == count_c) or any(len(x) == 0 for x in xs):
        raise ValueError("batched_sgd needs one non-empty (x, y, generator) per client.")
    names = [n for n in params if n in set(trainable)]
    aux = aux or {}
    sizes = [len(x) for x in xs]
    full = [n // batch_size for n in sizes]
    perm = sorted(range(count_c), key=lambda c: -full[c])  # stack order: most full batches first
    inv = torch.tensor(perm).argsort()
    device = xs[0].device
    theta = {n: t.detach()[perm].clone() for n, t in params.items()}
    aux_s = {n: t[perm] for n, t in aux.items()}
    velocity = {n: torch.zeros_like(theta[n]) for n in names}
    x_all, y_all = torch.cat([xs[c] for c in perm]), torch.cat([ys[c] for c in perm])
    offsets = torch.tensor([0, *torch.tensor([sizes[c] for c in perm]).cumsum(0).tolist()[:-1]], device=device)
    full_s = [full[c] for c in perm]
    totals = torch.zeros(count_c, dtype=torch.float64, device=device)

    def step(live: Params, frozen: Params, aux_c: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn({**frozen, **live}, aux_c, x, y)

    step_fn = vmap(grad_and_value(step))
    for _ in range(epochs):
        orders = [
            torch.randperm(sizes[c], generator=generators[c], device=generators[c].device).to(device) for c in perm
        ]
        width = max(full_s) * batch_size
        index = torch.zeros(count_c, max(width, 1), dtype=torch.long, device=device)
        for j, o in enumerate(orders):
            index[j, : full_s[j] * batch_size] = o[: full_s[j] * batch_size] + offsets[j]
        for s in range(max(full_s)):
            a = sum(1 for f in full_s if f > s)  # clients still running full batches: a prefix
            idx = index[:a, s * batch_size : (s + 1) * batch_size]
            live = {n: theta[n][:a] for n in names}
            frozen = {n: t[:a] for n, t in theta.items() if n not in live}
            grads, loss = step_fn(live, frozen, {n: t[:a] for n, t in aux_s.items()}, x_all[idx], y_all[idx])
            with torch.no_grad():
                _sgd_update(theta, names, grads, velocity, lr=lr, momentum=momentum, rows=slice(0, a))
                if project is not None:  # elementwise and idempotent: the clients that did not step keep theirs
                    theta.update(project(theta))
            totals[:a] += loss.detach().double() * batch_size
        rest = [sizes[c] - full_s[j] * batch_size for j, c in enumerate(perm)]
        for r in sorted(set(rest) - {0}):
            rows = torch.tensor([j for j in range(count_c) if rest[j] == r], device=device)
            idx = torch.stack([orders[j][full_s[j] * batch_size :] + offsets[j] for j in rows.tolist()])
            live = {n: theta[n][rows] for n in names}
            frozen = {n: t[rows] for n, t in theta.items() if n not in live}
            grads, loss = step_fn(live, frozen, {n: t[rows] for n, t in aux_s.items()}, x_all[idx], y_all[idx])
            with torch.no_grad():
                _sgd_update(theta, names, grads, velocity, lr=lr, momentum=momentum, rows=rows)
                if project is not None:
                    theta.update(project(theta))
            totals[rows] += loss.detach().double() * r
    means = totals / (epochs * torch.tensor([sizes[c] for c in perm], dtype=torch.float64, device=device))
    return {n: t[inv.to(t.device)] for n, t in theta.items()}, means[inv.to(device)].tolist()


@torch.no_grad()
def accuracy_and_loss_of(
    predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the logits ``predict(x)`` on (x, y), in batches."""
    if len(x) == 0:
        raise ValueError("cannot evaluate on zero records.")
    correct, loss = 0, 0.0
    for start in range(0, len(x), batch_size):
        logits = predict(x[start : start + batch_size])
        target = y[start : start + batch_size]
        correct += int((logits.argmax(1) == target).sum())
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
    return correct / len(x), loss / len(x)
