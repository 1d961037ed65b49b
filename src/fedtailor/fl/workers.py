"""Worker processes for the per-client path: the clients of a round run a method's ``client_fit`` on ``N``
processes (:class:`WorkerPool`), for models whose clients cannot be executed together in one process
(docs/pfl.md, "Worker processes").

* **Started once**, at the first round that uses them, with the ``spawn`` start method (a fork of a process whose
  torch threads have run can deadlock in the child); each worker imports torch and fedtailor again (about 3 s
  each on this machine), receives the method once, pickled at the start (its model, initialisation and
  options; its pool pickles to None, so in a worker the method runs its clients in process), sets its torch
  threads (the parent's count divided among the workers, at least 1) and ignores Ctrl-C, which is the parent's
  to handle: it closes the pool.
* **Per round** a client's task carries its message and state; its records travel the first time a worker runs
  that client and stay cached there (a client's :class:`~fedtailor.fl.records.ClientData` is fixed for a run),
  so over a run a worker receives each client's records at most once. Everything travels by value (plain
  pickle): no shared memory, no file descriptors kept per tensor. The clients go out largest first to whichever
  worker is free.
* **Results** are those of one ``client_fit`` per client in process, bit for bit at the same torch thread count
  per process, when ``client_fit`` draws its randomness from keys only (every fedtailor method does:
  ``(seed, "batches", round, client)``) and changes nothing of the method.
* **Errors**: an exception in a client's ``client_fit`` is raised here with its own type (its traceback in the
  worker as the cause, a note naming the client and the worker); a worker that dies raises :class:`WorkerError`.
  Either closes the pool first, so nothing waits on a worker that will not answer.
* **Trust**: pickle (multiprocessing's own, through ``Connection.recv``) crosses only the private pipes between
  this process and the workers it spawned, both ends running this code; nothing from a client node, a peer or a
  file is unpickled here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import traceback
import weakref
from collections.abc import Mapping
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from fedtailor.allocator import keep_freed_memory
from fedtailor.blas import single_thread_numpy_blas
from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, Message
from fedtailor.fl.setup import train_sizes

_STOP = pickle.dumps(None)


class WorkerError(RuntimeError):
    """A worker process died (killed, out of memory, a crash in native code) or could not start."""


class RemoteTraceback(Exception):
    """The traceback of an error raised in a worker process: the cause of that error re-raised here."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\n(in the worker process)\n{self.text}"


class WorkerPool:
    """``method.client_fit`` of a round's clients on ``workers`` processes, started at the first
    :meth:`client_fit_many` and stopped by :meth:`close` (after which the next call starts them again)."""

    def __init__(self, method: Method, *, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}.")
        self.method, self.workers = method, workers
        self.threads = 0  # torch threads per worker, set at the start
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._sent: list[dict[int, ClientData]] = []  # per worker: the records it holds, by client
        self._busy: set[int] = set()  # workers with a task in flight
        self._stop: weakref.finalize | None = None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _no_pool, ()  # a method sent to a worker arrives without its pool

    @property
    def running(self) -> bool:
        """Whether the worker processes are started (and not closed)."""
        return bool(self._procs)

    def start(self) -> None:
        """Start the workers (no-op when they run) and wait until each has loaded the method."""
        if self._procs:
            return
        try:
            blob = pickle.dumps(self.method, protocol=5)
        except Exception as err:
            raise TypeError(f"{type(self.method).__name__} cannot be sent to worker processes: {err}") from err
        self.threads = max(1, torch.get_num_threads() // self.workers)
        ctx = get_context("spawn")
        self._stop = weakref.finalize(self, _shutdown, self._procs, self._conns, self._busy)
        try:
            for _ in range(self.workers):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(there, self.threads), name="fedtailor-worker", daemon=True)
                proc.start()
                there.close()  # the worker holds its end: its death reads as end of file here
                self._procs.append(proc)
                self._conns.append(here)
                self._sent.append({})
            for w in range(self.workers):  # over the pipe, not as the process's arguments: a worker that dies
                self._send(w, blob)  # while starting is an error here, never a parent blocked writing to it
            for w in range(self.workers):
                self._receive(w, "loading the method")
        except BaseException:
            self.close()
            raise

    def client_fit_many(
        self, msgs: Mapping[int, Message], states: Mapping[int, Any], data: Mapping[int, ClientData]
    ) -> dict[int, tuple[Message, Any]]:
        """``method.client_fit(msgs[c], states.get(c), data[c])`` for every client ``c`` of ``msgs``, by client."""
        self.start()
        sizes = train_sizes({c: data[c] for c in msgs})
        pending = sorted(msgs, key=lambda c: (-sizes[c], c))  # largest first: the round ends sooner
        idle, running, out = list(range(self.workers)), {}, {}
        try:
            while pending or running:
                while pending and idle:
                    w, cid = idle.pop(0), pending.pop(0)
                    fresh = self._sent[w].get(cid) is not data[cid]
                    task = (cid, msgs[cid], states.get(cid), data[cid] if fresh else None)
                    self._send(w, pickle.dumps(task, protocol=5))
                    self._sent[w][cid] = data[cid]
                    running[w] = cid
                for conn in wait([self._conns[w] for w in running]):
                    w = self._conns.index(conn)
                    cid = running.pop(w)
                    out[cid] = self._receive(w, f"running client {cid}")
                    idle.append(w)
        except BaseException:  # a failure, Ctrl-C: no worker is left running a task nobody will read
            self.close()
            raise
        return {c: out[c] for c in sorted(out)}

    def close(self) -> None:
        """Stop the workers: idle ones are asked to exit, busy ones (Ctrl-C during a round) terminated."""
        if self._stop is not None:
            self._stop()
        self._procs, self._conns, self._sent, self._busy, self._stop = [], [], [], set(), None

    def _send(self, w: int, payload: bytes) -> None:
        self._busy.add(w)
        try:
            self._conns[w].send_bytes(payload)
        except OSError:
            raise self._died(w, "receiving a task") from None

    def _receive(self, w: int, doing: str) -> Any:
        """The answer of worker ``w``: its result, or the error it raised (re-raised here)."""
        try:
            kind, value, text = self._conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w, doing) from None
        self._busy.discard(w)
        if kind == "ok":
            return value
        where = f"in worker process {self._procs[w].pid} {doing}"
        if value is None:  # the error could not be pickled: its traceback is all there is
            raise WorkerError(f"error {where}:\n{text}")
        value.add_note(f"(raised {where})")
        raise value from RemoteTraceback(text)

    def _died(self, w: int, doing: str) -> WorkerError:
        proc = self._procs[w]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {-code} (out of memory? a crash in native code?)"
        else:  # an error outside a task, printed by the worker, e.g. a script without the spawn idiom
            how = f"exited with code {code} (its error is printed above; a script that starts a run needs the "
            how += '`if __name__ == "__main__":` idiom of multiprocessing\'s spawn)'
        return WorkerError(f"worker process {proc.pid} {how} while {doing}; the pool is closed.")


def _no_pool() -> None:
    return None


def _shutdown(procs: list[BaseProcess], conns: list[Connection], busy: set[int]) -> None:
    for w, (proc, conn) in enumerate(zip(procs, conns)):
        if w in busy:
            proc.terminate()
        else:
            with contextlib.suppress(OSError):
                conn.send_bytes(_STOP)
    for proc in procs:
        proc.join(timeout=30)  # an idle worker exits at once; a loaded machine can take seconds to schedule it
        if proc.is_alive():
            proc.terminate()
            proc.join()
    for conn in conns:
        conn.close()


def _answer(conn: Connection, kind: str, value: Any, text: str = "") -> None:
    conn.send_bytes(pickle.dumps((kind, value, text), protocol=5))


def _failure(conn: Connection, err: BaseException) -> None:
    """Send ``err`` back with its traceback (without the error itself when it cannot be pickled)."""
    text = "".join(traceback.format_exception(err))
    try:
        pickle.dumps(err)
    except Exception:
        _answer(conn, "error", None, text)
    else:
        _answer(conn, "error", err, text)


def _serve(conn: Connection, threads: int) -> None:
    """A worker: load the method (the first thing sent), then answer ``(cid, message, state, records or None)``
    tasks with ``client_fit``'s ``(reply, state)`` until told to stop (None) or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the pool
    keep_freed_memory()  # as the command line does (a user's own MALLOC_ settings, inherited, still win)
    single_thread_numpy_blas()  # likewise (numpy's idle BLAS threads would steal this worker's cores)
    torch.set_num_threads(threads)
    try:
        method = conn.recv()
    except Exception as err:
        _failure(conn, err)
        return
    _answer(conn, "ok", os.getpid())
    records: dict[int, ClientData] = {}
    with contextlib.suppress(EOFError):  # the parent is gone
        while (task := conn.recv()) is not None:
            cid, msg, state, data = task
            if data is not None:
                records[cid] = data
            try:
                result = method.client_fit(msg, state, records[cid])
                _answer(conn, "ok", result)
            except Exception as err:
                _failure(conn, err)
