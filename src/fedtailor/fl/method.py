"""The one abstraction every federated method implements (``docs/architecture.md``).

A method is a pair of pure-ish halves around a :class:`~fedtailor.fl.records.Message`:

* server side: ``configure_*`` makes one message per selected client from the server state, and
  ``aggregate_*`` folds the (validated) replies into a new server state;
* client side: ``client_*`` maps (message, the client's persistent state, its data) to (reply, new state).

Methods differ in what travels and what stays, not in the loop: the in-process loop (:mod:`fedtailor.fl.loop`)
and the Flower adapters drive these same functions. Phases: an optional one-shot ``setup`` exchange with every
client (e.g. a private context release), ``fit`` rounds on the scheduled clients, and ``evaluate``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from fedtailor.fl.records import ClientData, Message, Metrics

S = TypeVar("S")  # server state
C = TypeVar("C")  # per-client persistent state


class Method(ABC, Generic[S, C]):
    """Base class of federated methods. Subclasses set ``name`` and implement the abstract methods."""

    name: str = "method"

    # ----- server side -------------------------------------------------------------------------------
    @abstractmethod
    def init_server(self) -> S:
        """The initial server state (deterministic given the method's seed)."""

    def configure_setup(self, server: S, cid: int) -> Message | None:
        """The one-shot setup message for ``cid``, or None when the method has no setup phase."""
        return None

    def aggregate_setup(self, server: S, replies: dict[int, Message]) -> S:
        """Fold the setup replies (already validated) into the server state."""
        return server

    @abstractmethod
    def configure_fit(self, server: S, rnd: int, cid: int) -> Message:
        """The training message for client ``cid`` in round ``rnd`` (1-based)."""

    def validate_reply(self, server: S, phase: str, rnd: int, cid: int, reply: Message) -> None:
        """Raise :class:`~fedtailor.fl.records.InvalidMessage` if ``reply`` must be rejected.

        Called before aggregation; a rejected reply is dropped and logged, and the server state is untouched.
        """

    @abstractmethod
    def aggregate_fit(self, server: S, rnd: int, replies: dict[int, Message]) -> tuple[S, Metrics]:
        """The new server state and the round's server-side metrics."""

    #: True for a method that folds each validated fit reply into a running aggregate as it arrives
    #: (:meth:`fold_fit`, then :meth:`finish_fit`), so that a round never holds every client's reply at once
    #: (full language-model weights: memory stays near one client's); clients then run one after another.
    streaming: bool = False

    def fold_fit(self, server: S, rnd: int, acc: Any, cid: int, reply: Message) -> Any:
        """Fold one accepted reply into the round's accumulator ``acc`` (None before the first). The default
        keeps the replies, so that :meth:`finish_fit` is :meth:`aggregate_fit`; streaming methods override both
        with a running aggregate."""
        return {**(acc or {}), cid: reply}

    def finish_fit(self, server: S, rnd: int, acc: Any) -> tuple[S, Metrics]:
        """The new server state from the accumulator of the round's accepted replies."""
        return self.aggregate_fit(server, rnd, acc)

    @abstractmethod
    def configure_evaluate(self, server: S, cid: int) -> Message:
        """The evaluation message for client ``cid``."""

    # ----- client side -------------------------------------------------------------------------------
    def init_client(self, cid: int) -> C | None:
        """A client's persistent state before it first takes part (None if it keeps nothing)."""
        return None

    def client_setup(self, msg: Message, state: C | None, data: ClientData) -> tuple[Message, C | None]:
        raise TypeError(f"{type(self).__name__} sent a setup message but does not implement client_setup.")

    @abstractmethod
    def client_fit(self, msg: Message, state: C | None, data: ClientData) -> tuple[Message, C | None]:
        """Local work of one round: the reply and the client's new persistent state."""

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, C | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, C | None]]:
        """The fit phase of several clients of one round; each client's result must equal its own
        :meth:`client_fit` (methods may execute them together, e.g. vectorized; the default runs one by one)."""
        return {cid: self.client_fit(msgs[cid], states.get(cid), data[cid]) for cid in sorted(msgs)}

    @abstractmethod
    def client_evaluate(self, msg: Message, state: C | None, data: ClientData) -> Metrics:
        """Per-client metrics on its evaluation records; must include ``num_examples``. ``data.train`` is None when
        the records evaluated are the client's validation records (:func:`fedtailor.fl.loop.evaluate_client`)."""

    # ----- run-level extras ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the method holds outside its states (a temporary file of a round that did not finish);
        the runner calls it however a run ends, error or Ctrl-C included. The default holds nothing."""

    def summary(self, server: S) -> dict[str, Any]:
        """Method-specific facts for the run's results (e.g. eps and sigma); JSON-serialisable."""
        return {}

    def deployment_risks(self) -> dict[str, str]:
        """Settings of this method that void its guarantee outside simulation, by name (``simulation-randomness``,
        ``diagnostics``, ``unpadded``) with the reason; a deployment refuses each unless explicitly allowed."""
        return {}

    def artifacts(self, server: S) -> dict[str, str]:
        """Files (name -> text) the run directory keeps besides the results, e.g. the privacy ledger."""
        return {}
