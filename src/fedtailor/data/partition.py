"""Federated label partitions: equal-size Dirichlet clients, seen/unseen roles, train/eval/context splits.

Implements the data protocol of ``docs/data.md``. The default scheme ("dirichlet-equal") gives every client
the same number of records n: client i draws class proportions q_i ~ Dir(alpha 1) and is filled to n records
by drawing a class from q_i (renormalised over the classes that still have records) and then a record of
that class without replacement. Clients are filled *interleaved* -- one record per client per pass, in a
freshly shuffled client order each pass -- so that running out of a class hits all clients alike; filled
one client after another, the last clients would get whatever is left and stop following Dir(alpha).

The fill is vectorised: every client of a pass draws its class at once from the availability at the
start of the pass (inverse CDF of uniforms), and while no class can run out, whole blocks of passes are
drawn at once. If a pass draws a class more often than it has records left, the first drawers in the
pass order get them and only the others draw again, against the updated availability with that class
now exhausted. Each re-draw round exhausts at least one class, so a pass takes at most
``num_classes + 1`` rounds and the whole fill at most ``num_classes`` such stops: no unbounded retry loop.

Dirichlet rows are sampled in log space, log Gamma(alpha) = log Gamma(alpha + 1) + log(U) / alpha
(Marsaglia and Tsang's boost), and renormalised with a max-shift, so a tiny alpha (1e-3) cannot
underflow to an all-zero row or produce NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from fedtailor.rng import numpy_rng

__all__ = [
    "ClientIndices",
    "FederatedPartition",
    "Scheme",
    "class_histogram",
    "dirichlet_equal_partition",
    "dirichlet_per_class_partition",
    "federated_partition",
    "format_partition_table",
    "holdout_validation",
    "iid_partition",
    "plot_partition",
    "sample_log_dirichlet",
]

Scheme = Literal["dirichlet-equal", "dirichlet-per-class", "iid"]
SCHEMES: tuple[str, ...] = ("dirichlet-equal", "dirichlet-per-class", "iid")


@dataclass(frozen=True)
class ClientIndices:
    """Record indices of one client (all int64, sorted).

    ``train``: private training records (empty for an unseen client). ``eval``: held-out evaluation
    records (seen) or the query set (unseen). ``context``: the conditioning set C_i of m_c records, a subset
    of ``train`` for a seen client and disjoint from ``eval`` for an unseen one. ``val``: validation records
    held out of a seen client's training records besides ``eval`` (:func:`holdout_validation` with
    ``alongside``; empty otherwise).
    """

    client_id: int
    seen: bool
    train: np.ndarray
    eval: np.ndarray
    context: np.ndarray
    val: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def records(self) -> np.ndarray:
        """All of the client's records (sorted)."""
        return np.union1d(np.union1d(np.union1d(self.train, self.eval), self.context), self.val)


@dataclass(frozen=True)
class FederatedPartition:
    """A partition of a labelled pool into clients; ``clients[i].client_id == i``."""

    clients: tuple[ClientIndices, ...]
    seen: tuple[int, ...]
    unseen: tuple[int, ...]
    num_classes: int

    def __post_init__(self) -> None:
        for position, c in enumerate(self.clients):
            if c.client_id != position:
                raise ValueError(f"clients[{position}] has client_id {c.client_id}; ids must equal positions")
        if tuple(sorted(self.seen)) != self.seen or tuple(sorted(self.unseen)) != self.unseen:
            raise ValueError("seen and unseen ids must be sorted")
        if sorted(self.seen + self.unseen) != list(range(len(self.clients))):
            raise ValueError("seen and unseen ids must split 0..num_clients-1 between them")
        if any(self.clients[i].seen for i in self.unseen) or not all(self.clients[i].seen for i in self.seen):
            raise ValueError("ClientIndices.seen disagrees with the seen/unseen id lists")

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client(self, cid: int) -> ClientIndices:
        """Client ``cid`` (0-based)."""
        if not 0 <= cid < len(self.clients):
            raise IndexError(f"client id {cid} out of range 0..{len(self.clients) - 1}")
        return self.clients[cid]


# ------------------------------------------------------------------------------------ label partitions


def _check_labels(labels: np.ndarray) -> tuple[np.ndarray, int]:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be a non-empty 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.min() < 0:
        raise ValueError(f"labels must be non-negative class ids, got minimum {labels.min()}")
    return labels.astype(np.int64, copy=False), int(labels.max()) + 1


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(
            f"Dirichlet concentration alpha must be a finite number > 0, got {alpha!r} "
            "(use scheme='iid' for no label skew)"
        )


def _check_num_clients(num_clients: int, n: int) -> None:
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > n:
        raise ValueError(f"num_clients={num_clients} exceeds the {n} records available")


def sample_log_dirichlet(alpha: float, rows: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` draws of log q, q ~ Dir(alpha 1_dim), as a ``(rows, dim)`` array of finite values.

    Uses log Gamma(alpha) = log Gamma(alpha + 1) + log(U) / alpha, which stays finite where Gamma(alpha)
    itself underflows to 0 (alpha around 1e-3), then normalises with a log-sum-exp.
    """
    _check_alpha(alpha)
    g = rng.standard_gamma(alpha + 1.0, size=(rows, dim))
    u = rng.random((rows, dim))
    log_g = np.log(np.maximum(g, np.finfo(np.float64).tiny)) + np.log1p(-u) / alpha
    top = log_g.max(axis=1, keepdims=True)
    return log_g - (top + np.log(np.exp(log_g - top).sum(axis=1, keepdims=True)))


def _inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Column index drawn from each row of unnormalised weights ``p`` (rows with max 1) by uniforms ``u``."""
    cdf = np.cumsum(p, axis=1)
    # u <= 1 - 2^-53 keeps u * total < total under round-to-nearest, so the index is at most the last
    # column, and cdf[j - 1] <= target < cdf[j] means p[j] > 0: a zero-weight column is never drawn.
    return (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)


class _ClassPools:
    """Record ids grouped by class, shuffled within each class; each pool is consumed front to back."""

    def __init__(self, labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> None:
        shuffled = rng.permutation(labels.size)
        self.records = shuffled[np.argsort(labels[shuffled], kind="stable")]
        self.remaining = np.bincount(labels, minlength=num_classes)
        self.next = np.concatenate(([0], np.cumsum(self.remaining)[:-1]))  # next unused position per class
        self.num_classes = num_classes

    def take_first_come(self, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Serve class requests in the given order while records last: (won mask, records of the winners)."""
        by_class = np.argsort(cls, kind="stable")  # stable: request order kept within a class
        sorted_cls = cls[by_class]
        rank = np.empty_like(cls)
        rank[by_class] = np.arange(cls.size) - np.searchsorted(sorted_cls, sorted_cls, side="left")
        won = rank < self.remaining[cls]
        won_cls = cls[won]
        records = self.records[self.next[won_cls] + rank[won]]
        served = np.bincount(won_cls, minlength=self.num_classes)
        self.next += served
        self.remaining -= served
        return won, records


def _masked_weights(log_q: np.ndarray, available: np.ndarray) -> np.ndarray:
    """q renormalised over the available classes, up to a per-row factor (row max 1; never all zero)."""
    logits = np.where(available, log_q, -np.inf)
    return np.exp(logits - logits.max(axis=1, keepdims=True))


def dirichlet_equal_partition(
    labels: np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    size: int | None = None,
) -> list[np.ndarray]:
    """Equal-size Dirichlet label partition, filled interleaved (see the module docstring).

    Every client gets ``size`` records (default ``len(labels) // num_clients``); the at most
    ``len(labels) - num_clients * size`` records left over belong to no client. Returns one sorted int64
    index array per client.

    Passes are drawn in blocks: B passes at once from the current availability, sized by the expected
    number of passes until some class runs out. The block is kept up to its first pass that empties a
    class (kept whole) or over-demands one; an over-demanding pass is resolved first-come from its own
    draws, then the rest of the block is discarded -- a decision that depends only on earlier passes, so
    the law is that of filling one pass at a time. Every stop empties a class: at most num_classes stops.
    """
    labels, num_classes = _check_labels(labels)
    _check_num_clients(num_clients, labels.size)
    per_client = labels.size // num_clients if size is None else size
    if not isinstance(per_client, (int, np.integer)) or per_client < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    if per_client * num_clients > labels.size:
        raise ValueError(
            f"{num_clients} clients x size {per_client} = {per_client * num_clients} records, "
            f"but only {labels.size} exist; lower size or num_clients"
        )
    log_q = sample_log_dirichlet(alpha, num_clients, num_classes, rng)
    pools = _ClassPools(labels, num_classes, rng)
    max_block = max(1, _BLOCK_ELEMENTS // (num_clients * num_classes))

    out = np.empty((num_clients, per_client), dtype=np.int64)
    step = 0
    while step < per_client:
        available = pools.remaining > 0
        weights = _masked_weights(log_q, available)
        demand = (weights / weights.sum(axis=1, keepdims=True)).sum(axis=0)  # expected requests per pass
        horizon = np.min(pools.remaining[available] / np.maximum(demand[available], 1e-300))
        block = int(min(per_client - step, max_block, 1.25 * horizon + 1))
        order = rng.permuted(np.tile(np.arange(num_clients), (block, 1)), axis=1)  # each pass's client order
        cls = _inverse_cdf(weights[order.ravel()], rng.random(block * num_clients)).reshape(block, num_clients)
        per_pass = np.bincount(
            (np.arange(block)[:, None] * num_classes + cls).ravel(), minlength=block * num_classes
        ).reshape(block, num_classes)
        reach = (np.cumsum(per_pass, axis=0) >= pools.remaining) & available
        stop = int(np.argmax(reach.any(axis=1))) if reach.any() else block
        conflict = stop < block and bool((per_pass[: stop + 1].sum(axis=0) > pools.remaining).any())
        clean = stop if conflict or stop == block else stop + 1
        if clean:
            _, records = pools.take_first_come(cls[:clean].ravel())  # no class over-demanded: all win
            out[order[:clean].ravel(), np.repeat(np.arange(step, step + clean), num_clients)] = records
        step += clean
        if conflict:
            _resolve_pass(out, step, order[stop], cls[stop], log_q, pools, rng)
            step += 1
    return [np.sort(row) for row in out]


# Bound on the (passes x clients x classes) weights gathered per block (16 MiB of float64).
_BLOCK_ELEMENTS = 1 << 21


def _resolve_pass(
    out: np.ndarray,
    step: int,
    pending: np.ndarray,
    cls: np.ndarray,
    log_q: np.ndarray,
    pools: _ClassPools,
    rng: np.random.Generator,
) -> None:
    """One pass with contested classes: first-come in pass order wins; losers re-draw against the updated
    availability. Each round empties every over-demanded class, and there are at least as many records
    left as clients, so this takes at most num_classes + 1 rounds."""
    while True:
        won, records = pools.take_first_come(cls)
        out[pending[won], step] = records
        pending = pending[~won]
        if not pending.size:
            return
        weights = _masked_weights(log_q[pending], pools.remaining > 0)
        cls = _inverse_cdf(weights, rng.random(pending.size))


def dirichlet_per_class_partition(
    labels: np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Per-class Dirichlet partition (Hsu et al. 2019 style): unequal client sizes, every record used.

    For each class, proportions p ~ Dir(alpha 1_num_clients) over clients split that class's shuffled
    records by cumulative floor. Instead of the usual unbounded "redraw until every client has min_size
    records", deficient clients (in random order) are topped up with random records of the currently
    largest client until they hold ``min_size``: at most 2 x num_clients moves.
    """
    labels, num_classes = _check_labels(labels)
    _check_num_clients(num_clients, labels.size)
    if not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative integer, got {min_size!r}")
    if min_size * num_clients > labels.size:
        raise ValueError(f"min_size={min_size} x {num_clients} clients exceeds the {labels.size} records")
    owner = np.empty(labels.size, dtype=np.int64)
    log_p = sample_log_dirichlet(alpha, num_classes, num_clients, rng)
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.floor(np.cumsum(np.exp(log_p[c])) * members.size).astype(np.int64)
        cuts[-1] = members.size
        owner[members] = np.repeat(np.arange(num_clients), np.diff(cuts, prepend=0))

    sizes = np.bincount(owner, minlength=num_clients)
    for client in rng.permutation(np.flatnonzero(sizes < min_size)):
        while sizes[client] < min_size:
            donor = int(np.argmax(sizes))
            give = min(min_size - sizes[client], sizes[donor] - min_size)
            moved = rng.choice(np.flatnonzero(owner == donor), size=give, replace=False)
            owner[moved] = client
            sizes[donor] -= give
            sizes[client] += give
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(sizes)[:-1])


def iid_partition(labels: np.ndarray, *, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Equal random split, ``len(labels) // num_clients`` records each (the remainder is left out)."""
    labels, _ = _check_labels(labels)
    _check_num_clients(num_clients, labels.size)
    per_client = labels.size // num_clients
    perm = rng.permutation(labels.size)[: per_client * num_clients]
    return [np.sort(row) for row in perm.reshape(num_clients, per_client)]


# ---------------------------------------------------------------------------- federated roles + splits


def _eval_count(n: int, eval_fraction: float) -> int:
    return math.floor(eval_fraction * n + 0.5)


def _min_client_size(eval_fraction: float, context_size: int) -> int:
    """Smallest client size that works as a seen client (train >= m_c, eval >= 1) and an unseen one."""
    n = context_size + 1
    while n - _eval_count(n, eval_fraction) < context_size or _eval_count(n, eval_fraction) < 1:
        n += 1
    return n


def federated_partition(
    labels: np.ndarray,
    *,
    num_clients: int = 50,
    num_unseen: int = 10,
    alpha: float = 0.5,
    scheme: Scheme = "dirichlet-equal",
    eval_fraction: float = 0.2,
    context_size: int = 333,
    min_records: int = 0,
    seed: int,
) -> FederatedPartition:
    """The federated split of ``docs/data.md``, determined by ``seed`` alone.

    1. Label partition of all records into ``num_clients`` clients (``scheme``), key (seed, "partition").
    2. ``num_unseen`` clients chosen uniformly at random as unseen ("Future"), key (seed, "partition",
       "unseen").
    3. Per client, key (seed, "partition", "split", client): a seen client's records are split into eval
       (``round(eval_fraction * n)``) and train (the rest), and its context is the first ``context_size``
       records of a random permutation of train; an unseen client's context is ``context_size`` random
       records and its query (eval) set is the rest.

    ``min_records``: every client holds at least this many records (the per-class Dirichlet scheme moves
    records from the largest clients to reach it; the other schemes fail with a clear error if they miss it).
    """
    labels, num_classes = _check_labels(labels)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    _check_num_clients(num_clients, labels.size)
    if not isinstance(num_unseen, (int, np.integer)) or not 0 <= num_unseen <= num_clients:
        raise ValueError(f"num_unseen must be an integer in [0, num_clients={num_clients}], got {num_unseen!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction!r} (0.2 gives a 4:1 split)")
    if not isinstance(context_size, (int, np.integer)) or context_size < 0:
        raise ValueError(f"context_size must be a non-negative integer, got {context_size!r}")
    need = max(_min_client_size(eval_fraction, context_size), int(min_records))

    rng = numpy_rng(seed, "partition")
    if scheme == "dirichlet-equal":
        parts = dirichlet_equal_partition(labels, num_clients=num_clients, alpha=alpha, rng=rng)
    elif scheme == "dirichlet-per-class":
        parts = dirichlet_per_class_partition(labels, num_clients=num_clients, alpha=alpha, rng=rng, min_size=need)
    else:
        parts = iid_partition(labels, num_clients=num_clients, rng=rng)
    smallest = int(np.argmin([p.size for p in parts]))
    if parts[smallest].size < need:
        raise ValueError(
            f"client {smallest} has {parts[smallest].size} records but a client needs at least {need} "
            f"(context_size={context_size}, eval_fraction={eval_fraction}); use fewer clients or a smaller "
            "context_size"
        )

    unseen = np.sort(numpy_rng(seed, "partition", "unseen").choice(num_clients, size=num_unseen, replace=False))
    is_unseen = np.zeros(num_clients, dtype=bool)
    is_unseen[unseen] = True
    clients = []
    for cid, records in enumerate(parts):
        perm = numpy_rng(seed, "partition", "split", cid).permutation(records)
        if is_unseen[cid]:
            clients.append(
                ClientIndices(
                    cid,
                    False,
                    np.empty(0, dtype=np.int64),
                    np.sort(perm[context_size:]),
                    np.sort(perm[:context_size]),
                )
            )
        else:
            n_eval = _eval_count(perm.size, eval_fraction)
            train = perm[n_eval:]
            clients.append(
                ClientIndices(cid, True, np.sort(train), np.sort(perm[:n_eval]), np.sort(train[:context_size]))
            )
    return FederatedPartition(
        clients=tuple(clients),
        seen=tuple(int(i) for i in np.flatnonzero(~is_unseen)),
        unseen=tuple(int(i) for i in unseen),
        num_classes=num_classes,
    )


def holdout_validation(
    partition: FederatedPartition, *, fraction: float, seed: int, alongside: bool = False
) -> FederatedPartition:
    """The partition with a validation split: ``round(fraction * |train|)`` of each seen client's training
    records outside its context set (key (seed, "partition", "validation", client)), removed from its training
    records; its context set is unchanged, so the context release is the same as in the real run.

    By default (for choosing hyperparameters: no test or query record is used) the validation records become
    each seen client's evaluation set, and unseen clients keep their context and get an empty evaluation set
    (their query records are test data): they are not evaluated. ``alongside``: every client keeps its
    evaluation set (test or query records) and each seen client holds its validation records apart (``val``).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation fraction must lie in (0, 1), got {fraction!r} (for example 0.2).")
    clients = []
    for c in partition.clients:
        if not c.seen:
            kept = c.eval if alongside else np.empty(0, dtype=np.int64)
            clients.append(ClientIndices(c.client_id, False, c.train, kept, c.context))
            continue
        outside = np.setdiff1d(c.train, c.context)
        n_val = round(fraction * c.train.size)
        if not 0 < n_val <= outside.size:
            raise ValueError(
                f"client {c.client_id} has {outside.size} training records outside its context set, cannot hold out "
                f"{n_val} for validation; use a validation fraction below {outside.size / max(c.train.size, 1):.2f}."
            )
        rng = numpy_rng(seed, "partition", "validation", c.client_id)
        val = np.sort(rng.choice(outside, size=n_val, replace=False))
        train = np.setdiff1d(c.train, val)
        if alongside:
            clients.append(ClientIndices(c.client_id, True, train, c.eval, c.context, val))
        else:
            clients.append(ClientIndices(c.client_id, True, train, val, c.context))
    return FederatedPartition(
        clients=tuple(clients), seen=partition.seen, unseen=partition.unseen, num_classes=partition.num_classes
    )


# ------------------------------------------------------------------------------------------ summaries


def class_histogram(labels: np.ndarray, partition: FederatedPartition) -> np.ndarray:
    """``(num_clients, num_classes)`` label counts over each client's records (train, eval and context)."""
    labels = np.asarray(labels)
    hist = np.zeros((partition.num_clients, partition.num_classes), dtype=np.int64)
    for c in partition.clients:
        hist[c.client_id] = np.bincount(labels[c.records], minlength=partition.num_classes)
    return hist


def _tv_to_global(hist: np.ndarray) -> np.ndarray:
    """Total-variation distance of each client's class distribution from the pooled one."""
    pooled = hist.sum(axis=0) / hist.sum()
    shares = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
    return 0.5 * np.abs(shares - pooled).sum(axis=1)


def format_partition_table(labels: np.ndarray, partition: FederatedPartition, *, max_rows: int = 60) -> str:
    """Plain-text table, one row per client: role, n_train, n_eval, n_context, class counts, TV skew.

    ``tv`` is the total-variation distance of the client's class distribution from the pooled one (0: the
    same mix as the pool, 1: disjoint classes). Beyond ``max_rows`` clients the rest are summarised.
    """
    hist = class_histogram(labels, partition)
    tv = _tv_to_global(hist)
    header = ["client", "role", "n_train", "n_eval", "n_ctx"] + [f"c{k}" for k in range(partition.num_classes)]
    header.append("tv")
    rows = []
    for c in partition.clients[:max_rows]:
        rows.append(
            [
                str(c.client_id),
                "seen" if c.seen else "unseen",
                str(c.train.size),
                str(c.eval.size),
                str(c.context.size),
                *(str(v) for v in hist[c.client_id]),
                f"{tv[c.client_id]:.3f}",
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += [" ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    if partition.num_clients > max_rows:
        lines.append(f"... {partition.num_clients - max_rows} more clients not shown (max_rows={max_rows})")
    seen, unseen = list(partition.seen), list(partition.unseen)
    mean_seen = tv[seen].mean() if seen else float("nan")
    mean_unseen = tv[unseen].mean() if unseen else float("nan")
    lines.append(
        f"{partition.num_clients} clients ({len(seen)} seen, {len(unseen)} unseen), {int(hist.sum())} of "
        f"{np.asarray(labels).size} records assigned; mean tv: seen {mean_seen:.3f}, unseen {mean_unseen:.3f}"
    )
    return "\n".join(lines)


def plot_partition(labels: np.ndarray, partition: FederatedPartition, path: str | Path) -> Path:
    """Stacked bars of each client's class proportions, unseen clients marked, written as a PNG."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = class_histogram(labels, partition)
    shares = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
    k, num_classes = shares.shape
    fig = Figure(figsize=(min(max(6.0, 0.16 * k + 2.0), 40.0), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"]
    bottom = np.zeros(k)
    x = np.arange(k)
    for cls in range(num_classes):
        ax.bar(x, shares[:, cls], bottom=bottom, width=0.9, color=cmap(cls % cmap.N), label=str(cls), linewidth=0)
        bottom += shares[:, cls]
    if partition.unseen:
        ax.scatter(
            list(partition.unseen),
            [1.03] * len(partition.unseen),
            marker="v",
            color="black",
            s=12,
            label="unseen",
            clip_on=False,
        )
    ax.set_xlim(-0.6, k - 0.4)
    ax.set_ylim(0, 1)
    ax.set_xlabel("client")
    ax.set_ylabel("class share")
    ax.set_title(f"class proportions of {k} clients ({len(partition.unseen)} unseen, marked)", pad=14)
    ax.legend(ncol=1, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), title="class")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out
