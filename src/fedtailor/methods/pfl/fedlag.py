"""FedLAG (Federated Learning with Layer-wise Aggregation via Gradient Analysis), from *Towards Layer-Wise
Personalized Federated Learning: Adaptive Layer Disentanglement via Conflicting Gradients*, as one wrapper
around any parameter-sharing method of :mod:`fedtailor.methods.pfl.local` (FedAvg, FedProx, FedPer, FedRep, FedBABU,
Ditto, FedRoD, LG-FedAvg, APFL), in the shape of a strategy wrapper: the base method runs unchanged, the wrapper
only decides which layers the base shares. It uses the base through the Method interface and
:data:`~fedtailor.methods.pfl.local.WRAPPER_API` only, and its summary includes the base's.

Notation. Layers ``l`` are the model's parameter tensors or modules
(:func:`fedtailor.models.parts.layer_units`); the *candidates* are the layers outside the base's own personal
part. ``h_u(l)`` is client ``u``'s update of
layer ``l`` in a round: its round delta (new value minus the value it received; default) or the gradient of
its last minibatch (its last ``batch_size`` training records in storage order) at its final model.

Conflict score. Over the clients that replied, all pairwise cosines of a layer come from one Gram matrix
``G = H H^T`` (rows of ``H``: the ``h_u(l)``), ``cos(u, v) = G_uv / sqrt(G_uu G_vv)``; a pair conflicts when
its cosine is *strictly* below ``xi`` (default 0; pairs with a zero update are not counted).
``GC_xi(l)`` sums the conflicting pairs over the warm-up rounds. With ``cap`` set, a round's count is
:func:`capped_conflicts` instead: no client takes part in more than ``cap`` of the counted pairs, so one
client moves a layer's score by at most ``cap`` a round (the plain count: up to ``n - 1``).

Schedule. The first ``warmup`` rounds (default ``min(R // 2, 30)``) run the base with every candidate shared
while scoring; after round ``warmup`` the ``top_k`` layers with the largest ``GC_xi`` (ties to the earlier
layer) become personal: each client keeps its own copy, and they are never sent nor averaged. Every other
layer keeps being aggregated and delivered to every client. Options: keep scoring and re-choose after every
round (``rechoose``; a layer that returns to the shared set restarts from the server's last average of it,
and clients then report the round deltas of the FedLAG-personal layers for scoring, never those of the base's
own personal part), or a fixed choice of the
first, middle or last ``top_k`` candidates (``choice``; same warm-up, so only the choice differs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, InvalidMessage, Message, Metrics
from fedtailor.methods.pfl.local import LocalTraining, PersonalState, SharedState
from fedtailor.models.parts import LayerUnit, layer_units

Choice = Literal["conflict", "first", "middle", "last"]
REPORT = "report/"  # prefix of the update arrays a client reports for scoring


def conflict_matrix(updates: torch.Tensor, *, xi: float) -> torch.Tensor:
    """Symmetric boolean matrix (clients x clients, false on the diagonal) of the pairs of rows of
    ``updates`` (clients x coordinates) with cosine strictly below ``xi``, from one Gram matrix; rows of norm
    zero take part in no pair."""
    h = updates.to(torch.float64)
    gram = h @ h.T
    norms = gram.diagonal().sqrt()
    live = norms > 0
    cos = gram / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
    off = ~torch.eye(len(h), dtype=torch.bool, device=h.device)
    return (cos < xi) & off & live[:, None] & live[None, :]


def conflict_counts(updates: torch.Tensor, *, xi: float) -> int:
    """Number of pairs ``u < v`` of rows of ``updates`` (clients x coordinates) with cosine strictly below
    ``xi``, from one Gram matrix; rows of norm zero take part in no pair."""
    return int(torch.triu(conflict_matrix(updates, xi=xi), diagonal=1).sum())


def capped_conflicts(updates: torch.Tensor, *, xi: float, cap: int) -> float:
    """Conflict count of bounded influence: the largest number of conflicting pairs (those of
    :func:`conflict_counts`) that can be counted when no client takes part in more than ``cap`` of them, pairs
    counted fractionally. That is the fractional ``cap``-matching of the conflict graph::

        max sum_{u<v conflicting} x_uv   subject to   0 <= x_uv <= 1,   sum_v x_uv <= cap for every client u.

    Why: in the plain count one client whose update opposes everyone else's (e.g. the negative of the honest
    mean) adds ``n - 1`` conflicts to a layer every round. Here

    - **one client moves the score by at most** ``cap``: adding a client's row (and its pairs) raises the
      optimum by at most ``cap``, since an optimum restricted to the other pairs stays feasible and the new
      client's pairs carry at most ``cap``; removing it lowers the optimum by at most ``cap`` for the same
      reason; so replacing one client's update by anything moves the score by at most ``cap`` (``k`` clients:
      ``k * cap``);
    - ``cap >= n - 1`` is the plain count (every ``x_uv = 1`` is feasible), and a layer whose clients each
      conflict with at most ``cap`` others keeps its plain count; layers where many clients conflict with many
      others saturate near ``n * cap / 2``, so ``cap`` trades resolution among heavily conflicting layers
      for robustness.

    Computed exactly as half the maximum flow through the conflict graph's bipartite double cover (source ->
    ``u`` with capacity ``cap``, ``u`` -> ``v'`` with capacity 1 for every conflicting pair, both ways,
    ``v'`` -> sink with capacity ``cap``), whose optimum is integral: the score is a multiple of 1/2."""
    return capped_count(conflict_matrix(updates, xi=xi), cap=cap)


def capped_count(conflicts: torch.Tensor, *, cap: int) -> float:
    """The fractional ``cap``-matching number of a conflict graph given as a symmetric boolean matrix with a
    false diagonal (:func:`conflict_matrix`): the score of :func:`capped_conflicts`."""
    if cap < 1:
        raise ValueError(f"cap must be a positive number of pairs per client, got {cap}.")
    conflicts = conflicts.cpu()
    n = len(conflicts)
    if n == 0 or int(conflicts.sum(1).max()) <= cap:
        return float(int(conflicts.sum()) // 2)  # no client exceeds the cap: the plain count
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import maximum_flow

    u, v = (t.numpy() for t in conflicts.nonzero(as_tuple=True))
    clients = np.arange(n)
    source, sink = 2 * n, 2 * n + 1
    rows = np.concatenate([np.full(n, source), u, n + clients])
    cols = np.concatenate([clients, n + v, np.full(n, sink)])
    caps = np.concatenate([np.full(n, cap), np.ones(len(u), dtype=np.int64), np.full(n, cap)])
    graph = coo_matrix((caps.astype(np.int32), (rows, cols)), shape=(2 * n + 2, 2 * n + 2)).tocsr()
    return float(maximum_flow(graph, source, sink).flow_value) / 2


@dataclass
class LagState:
    """Server state: the base's, the accumulated scores GC(l) over candidates, the chosen candidates, and the
    per-round conflict counts (rows: scored rounds) for the report's heat map."""

    base: SharedState
    scores: list[float]  # ints with the plain count, multiples of 1/2 with a cap
    chosen: tuple[int, ...] = ()
    per_round: list[list[float]] = field(default_factory=list)


class FedLAG(Method[LagState, PersonalState]):
    def __init__(
        self,
        base: LocalTraining,
        *,
        top_k: int,
        xi: float,
        warmup: int | None,
        unit: LayerUnit,
        update: Literal["delta", "gradient"],
        rechoose: bool,
        choice: Choice,
        cap: int | None = None,
    ) -> None:
        self.base = base
        self.name = f"fedlag+{base.name}"
        self.layers = layer_units(base.model, unit)
        self.candidates = [i for i, lay in enumerate(self.layers) if not set(lay) & base.own_personal]
        if not 0 <= top_k <= len(self.candidates):
            raise ValueError(
                f"top_k={top_k} but the model has {len(self.candidates)} candidate layers (unit "
                f"{unit!r}, outside {base.name}'s own personal part); choose 0 <= top_k <= "
                f"{len(self.candidates)}."
            )
        self.top_k, self.xi, self.update, self.rechoose, self.choice = top_k, xi, update, rechoose, choice
        if cap is not None and cap < 1:
            raise ValueError(
                f"cap={cap}: a client must be allowed at least one conflicting pair (or none: the plain pair count)."
            )
        self.cap = cap
        self.warmup = min(base.rounds // 2, 30) if warmup is None else warmup
        if not 0 <= self.warmup <= base.rounds:
            raise ValueError(f"warmup={self.warmup} must lie in [0, rounds={base.rounds}].")

    # ----- choice ---------------------------------------------------------------------------------------
    def layer_score(self, updates: torch.Tensor) -> float:
        """One round's conflict score of one layer from its updates (clients x coordinates): the plain pair
        count, or with ``cap`` the capped count."""
        if self.cap is None:
            return conflict_counts(updates, xi=self.xi)
        return capped_conflicts(updates, xi=self.xi, cap=self.cap)

    def choose(self, scores: list[float]) -> tuple[int, ...]:
        """Indices into ``self.candidates`` of the personal layers."""
        k, n = self.top_k, len(self.candidates)
        if self.choice == "first":
            return tuple(range(k))
        if self.choice == "last":
            return tuple(range(n - k, n))
        if self.choice == "middle":
            start = (n - k) // 2
            return tuple(range(start, start + k))
        ranked = sorted(range(n), key=lambda j: (-scores[j], j))  # ties to the earlier layer
        return tuple(sorted(ranked[:k]))

    def personal_names(self, chosen: tuple[int, ...]) -> frozenset[str]:
        return frozenset(n for j in chosen for n in self.layers[self.candidates[j]])

    def scoring(self, rnd: int) -> bool:
        return rnd <= self.warmup or (self.rechoose and self.choice == "conflict")

    # ----- server side ----------------------------------------------------------------------------------
    def init_server(self) -> LagState:
        base, scores = self.base.init_server(), [0] * len(self.candidates)
        if self.warmup == 0:  # no warm-up: a fixed choice from round 1 (a conflict choice would be arbitrary)
            chosen = self.choose(scores)
            base = dataclasses.replace(base, personal=self.personal_names(chosen))
            return LagState(base=base, scores=scores, chosen=chosen)
        return LagState(base=base, scores=scores)

    def configure_fit(self, server: LagState, rnd: int, cid: int) -> Message:
        msg = self.base.configure_fit(server.base, rnd, cid)
        if self.scoring(rnd):
            if self.update == "gradient":
                msg.config["report"] = "gradient"
            elif server.base.personal:
                msg.config["report"] = "delta"  # personal layers are not sent: clients report their deltas
        return msg

    def _report_names(self, server: LagState, rnd: int) -> set[str]:
        if not self.scoring(rnd):
            return set()
        cand = {n for j in range(len(self.candidates)) for n in self.layers[self.candidates[j]]}
        return cand if self.update == "gradient" else set(server.base.personal)

    def validate_reply(self, server: LagState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        want = self._report_names(server, rnd)
        got = {n[len(REPORT) :] for n in reply.arrays if n.startswith(REPORT)}
        if got != want:
            raise InvalidMessage(
                f"reply must report updates of exactly {len(want)} layers' parameters; got "
                f"{sorted(got ^ want)[:5]} wrong."
            )
        for n in want:
            reply.array(REPORT + n, shape=tuple(self.base.shapes[n]))
        self.base.validate_reply(server.base, phase, rnd, cid, _without_reports(reply))

    def aggregate_fit(self, server: LagState, rnd: int, replies: dict[int, Message]) -> tuple[LagState, Metrics]:
        scores, per_round, chosen = list(server.scores), list(server.per_round), server.chosen
        if self.scoring(rnd):
            counts = []
            for j in range(len(self.candidates)):
                layer = self.layers[self.candidates[j]]
                rows = [torch.cat([self._update(server, r, n).reshape(-1) for n in layer]) for r in replies.values()]
                counts.append(self.layer_score(torch.stack(rows)))
            scores = [s + c for s, c in zip(scores, counts)]
            per_round.append(counts)
        plain = {c: _without_reports(r) for c, r in replies.items()}
        base, metrics = self.base.aggregate_fit(server.base, rnd, plain)
        if rnd == self.warmup or (rnd > self.warmup and self.rechoose and self.choice == "conflict"):
            chosen = self.choose(scores)
            base = dataclasses.replace(base, personal=self.personal_names(chosen))  # keeps a wrapper's fields
        metrics = {**metrics, "fedlag/personal_layers": len(chosen)}
        return LagState(base=base, scores=scores, chosen=chosen, per_round=per_round), metrics

    def _update(self, server: LagState, reply: Message, name: str) -> torch.Tensor:
        if REPORT + name in reply.arrays:
            return reply.arrays[REPORT + name]
        return reply.arrays[name] - server.base.params[name]  # the round delta of a shared layer

    def configure_evaluate(self, server: LagState, cid: int) -> Message:
        return self.base.configure_evaluate(server.base, cid)

    # ----- client side ----------------------------------------------------------------------------------
    def init_client(self, cid: int) -> PersonalState:
        return self.base.init_client(cid)

    def client_fit(self, msg: Message, state: PersonalState | None, data: ClientData) -> tuple[Message, PersonalState]:
        return self.client_fit_many({data.cid: msg}, {data.cid: state}, {data.cid: data})[data.cid]

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        """The base's fit (vectorized when the base is), then each client's requested reports."""
        starts = {c: self.base.start_model(msgs[c], states.get(c)) for c in msgs}
        out = self.base.client_fit_many(msgs, states, data)
        for c, (reply, new) in out.items():
            mode = msgs[c].config.get("report")
            start, _, received = starts[c]
            if mode == "delta":
                names = self.delta_report_names(received)
                reply.arrays.update({REPORT + n: new.params[n] - start[n] for n in names})
            elif mode == "gradient":
                grads = self._last_batch_gradient(new.params, data[c])
                reply.arrays.update({REPORT + n: g for n, g in grads.items()})
        return out

    def delta_report_names(self, received: dict[str, torch.Tensor]) -> tuple[str, ...]:
        """The names whose round deltas a client reports when asked for ``"delta"``: exactly the
        FedLAG-personal layers ``L``. The base sends ``S = all - O - L``, so what the client did not receive
        minus the base's own personal part ``O`` is ``L`` (the server's ``base.personal``, which
        :meth:`validate_reply` expects); the base's own head stays on the client."""
        return tuple(n for n in self.base.names if n not in received and n not in self.base.own_personal)

    def _last_batch_gradient(self, params: dict[str, torch.Tensor], data: ClientData) -> dict[str, torch.Tensor]:
        """Gradient of the mean cross-entropy of the client's last ``batch_size`` training records (storage
        order) at ``params``, for the candidate layers."""
        x, y = data.train
        b = self.base.batch_size
        live = {n: t.detach().requires_grad_(True) for n, t in params.items()}
        names = [n for i in self.candidates for n in self.layers[i]]
        loss = F.cross_entropy(self.base.logits(live, x[-b:]), y[-b:])
        grads = torch.autograd.grad(loss, [live[n] for n in names])
        return {n: g.detach() for n, g in zip(names, grads)}

    def client_evaluate(self, msg: Message, state: PersonalState | None, data: ClientData) -> Metrics:
        return self.base.client_evaluate(msg, state, data)

    def close(self) -> None:
        self.base.close()

    def artifacts(self, server: LagState) -> dict[str, str]:
        return self.base.artifacts(server.base)

    def deployment_risks(self) -> dict[str, str]:
        return self.base.deployment_risks()

    def summary(self, server: LagState) -> dict[str, Any]:
        names = ["+".join(self.layers[i]) for i in self.candidates]
        out = {
            "fedlag_candidates": names,
            "fedlag_scores": server.scores,
            "fedlag_personal": [names[j] for j in server.chosen],
            "fedlag_warmup": self.warmup,
            "fedlag_conflicts_per_round": server.per_round,
        }
        out = {**self.base.summary(server.base), **out}
        return out if self.cap is None else {**out, "fedlag_cap": self.cap}


def _without_reports(reply: Message) -> Message:
    """``reply`` without its reports: the same message when it has none (a wrapper below may decode a payload
    into it while validating, and the aggregation must then see the decoded values)."""
    if not any(n.startswith(REPORT) for n in reply.arrays):
        return reply
    arrays = {n: t for n, t in reply.arrays.items() if not n.startswith(REPORT)}
    return Message(arrays=arrays, config=reply.config)
