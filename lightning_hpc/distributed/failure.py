"""A failing rank's message, delivered to every peer through the process group's store before its process ends.

A rank that fails leaves its peers waiting in a collective or a point-to-point message with it; gloo releases
them only when the failing process closes its connections, that is when it exits (torch's ``abort`` of a gloo
process group closes nothing: a peer waiting on a receive from an aborted rank stays blocked until that rank's
process ends).  The peer then fails with gloo's "Connection closed by peer", and by then the store may be gone
too: rank 0 hosts the default store under Lightning's own launcher, SLURM and ``mp.spawn``, so a message left
there by a failing rank 0 cannot be read after its exit.

:class:`FailureMessages` therefore delivers the message while the failing rank is still alive: every rank keeps a
thread waiting on the store (on its own connection, a clone of the store) for a message addressed to it.  The
failing rank writes its message to every peer's key and waits until each peer's thread has taken it (milliseconds;
at most ``ack_timeout``), and only then goes on to end.  A peer that fails because its connection closed reports
the message its thread received.  Device-agnostic: only the store is used, whatever the backend, and the launcher
(torchrun's agent store, rank 0's store) makes no difference.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_hpc._compat import abort_process_groups, default_store

__all__ = ["FailureMessages", "RunFailures"]

#: how long one wait of the listening thread lasts before it waits again (it ends when stopped or messaged)
_WAIT = timedelta(days=1)

_live: weakref.WeakSet[FailureMessages] = weakref.WeakSet()
_atexit_registered = False


def _stop_all() -> None:
    for messages in list(_live):
        messages.stop()


class FailureMessages:
    """Delivery of one rank's failure message to its peers during one run (``key`` is the run's, the same on
    every rank).

    Every rank calls :meth:`start` once the process group is up and :meth:`stop` when the run ends (also after a
    failure); a rank that fails calls :meth:`publish`, a rank that failed because a peer went away asks
    :meth:`received`.  Keys: ``key/to/<rank>`` carries the message to a rank (empty: its thread is to stop),
    ``key/took/<rank>`` says that rank's thread has ended (with a message or without).
    """

    def __init__(self, store: Any, key: str, rank: int, world_size: int) -> None:
        self.store, self.key, self.rank, self.world_size = store, key, rank, world_size
        self._message: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False

    def _to(self, rank: int) -> str:
        return f"{self.key}/to/{rank}"

    def _took(self, rank: int) -> str:
        return f"{self.key}/took/{rank}"

    def start(self) -> None:
        """Start this rank's listening thread (on a clone of the store: one connection per thread)."""
        global _atexit_registered
        if self._thread is not None or self.world_size < 2:
            return
        listener = self.store.clone()
        self._thread = threading.Thread(target=self._listen, args=(listener,), name="lightning_hpc-failure-messages",
                                        daemon=True)
        self._thread.start()
        self._started = True
        _live.add(self)
        if not _atexit_registered:  # a run that never reaches stop() must not leave the thread in the store at exit
            atexit.register(_stop_all)
            _atexit_registered = True

    def _listen(self, store: Any) -> None:
        try:
            while True:
                try:
                    store.wait([self._to(self.rank)], _WAIT)
                    break
                except Exception as e:  # noqa: BLE001 - a timeout waits again, a closed store ends the thread
                    if "timeout" not in str(e).lower():
                        return
                    store = self.store.clone()  # a fresh connection: the timed-out wait may still be answered
            text = store.get(self._to(self.rank)).decode(errors="replace")
            if text:
                self._message = text
            store.set(self._took(self.rank), b"1")
        except Exception:  # noqa: BLE001 - the store went away (its host ended): no message to report
            pass
        finally:
            self._done.set()

    def publish(self, message: str, ack_timeout: float = 30.0) -> bool:
        """Send ``message`` to every peer and wait until each has taken it (or ended its run), at most
        ``ack_timeout`` seconds; True when every peer took it in time."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        if not peers:
            return True
        data = message.encode()
        self.store.multi_set([self._to(r) for r in peers], [data] * len(peers))
        try:
            self.store.wait([self._took(r) for r in peers], timedelta(seconds=ack_timeout))
        except Exception:  # noqa: BLE001 - a peer without a listening thread (its process died): go on
            return False
        return True

    def received(self, timeout: float = 3.0) -> str | None:
        """The message a peer sent this rank, waiting at most ``timeout`` seconds for it (None: no message, or
        this rank never started listening)."""
        if not self._started:
            return None
        self._done.wait(timeout)
        return self._message

    def stop(self, timeout: float = 5.0) -> None:
        """End this rank's listening thread (it takes the empty message addressed to itself)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        _live.discard(self)
        if not self._done.is_set():
            try:
                self.store.compare_set(self._to(self.rank), b"", b"")  # sets it when absent; a message stays
            except Exception:  # noqa: BLE001 - no store left: the thread has ended (or ends with the process)
                pass
        thread.join(timeout)


#: the text of an error a rank gets when a peer went away (its exit closed the connections): such a rank reports
#: the peer's message instead of its own
_COMM_FAILURE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "Timed out",
)


class RunFailures:
    """A strategy's failure sharing over its runs: :meth:`start` once the process group is up (each run listens
    under a key of its own), :meth:`share` from the strategy's ``on_exception``, :meth:`stop` at teardown.  ``name``
    prefixes a message that reached a rank from its peer (``"spatial: rank 1: ValueError: ... -- which ended this
    rank too"``)."""

    _runs = 0

    def __init__(self, name: str) -> None:
        self.name = name
        self.messages: FailureMessages | None = None

    def start(self) -> None:
        """Listen for a peer's failure message during this run (nothing in one process, or without a store)."""
        self.stop()  # set up again without a teardown: the earlier run's listener ends
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return
        RunFailures._runs += 1
        try:
            store = default_store()
        except Exception:  # noqa: BLE001 - no store: nothing to share
            return
        messages = FailureMessages(store, f"lightning_hpc/{self.name}/failure/{RunFailures._runs}", dist.get_rank(),
                                   dist.get_world_size())
        try:
            messages.start()
        except Exception:  # noqa: BLE001 - a store that cannot be cloned: failures end the peers without a message
            return
        self.messages = messages

    def stop(self) -> None:
        if self.messages is not None:
            self.messages.stop()
            self.messages = None

    def share(self, exception: BaseException) -> None:
        """A failure on this rank ends every rank promptly with its message: the message goes to every peer
        through the store (each peer's listening thread takes it at once, whatever its main thread waits on)
        before this rank goes on to end; its exit closes its connections, so a peer waiting on it in a collective
        fails at once instead of at the collective timeout, and a rank that failed because its peer went away
        reports the peer's message (``exception``'s text is replaced).  Rank 0 also aborts its process groups
        (backends whose ``abort`` closes their connections, NCCL, release the peers before its exit; gloo's
        closes nothing).  A refusal raised on every rank at once is each rank's own message."""
        messages = self.messages
        if messages is None or not dist.is_initialized():
            return
        rank, text = dist.get_rank(), f"{type(exception).__name__}: {exception}"
        try:
            if any(s in text for s in _COMM_FAILURE):
                peer = messages.received()
                if peer is not None and not peer.startswith(f"rank {rank}:"):
                    exception.args = (f"{self.name}: {peer} -- which ended this rank too ({text[:300]})",)
            else:
                messages.publish(f"rank {rank}: {text}")
                if rank == 0:
                    abort_process_groups()
        except Exception:  # noqa: BLE001 - best effort: the original exception is raised anyway
            pass
