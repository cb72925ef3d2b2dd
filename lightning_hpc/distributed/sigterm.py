"""SIGTERM ends every rank promptly: Lightning's SIGTERM notifier without its collective.

Lightning's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``, Lightning 2.6) records the signal, forwards
it to the processes its launcher started, and then calls ``torch.distributed.broadcast`` *from inside the signal
handler*.  Python runs a signal handler between two bytecodes of the main thread, wherever that thread is, so the
broadcast is issued in the middle of whatever sequence of collectives the rank was running.  Under DDP a step has
few collectives (the bucketed allreduce runs in the reducer, in C++) and the stray broadcast mostly meets
Lightning's own per-batch broadcast; under a strategy with many collectives and point-to-point messages per step
(multigrid's relaxation sweeps, hybrid_fc's head exchanges, layered SGD's group reductions) it pairs with a
different collective on the other ranks, the ranks' sequences of collectives no longer match, and every rank waits
for a message no peer will send -- until the process group's timeout (30 minutes by default): the signal is
printed on every rank, and the job stays alive.  Whether it hangs depends on where each rank is when the signal
lands: a race, not a rule (the same hang is possible under DDP, and was seen with the signal sent to one rank).

:func:`sigterm_without_collective` replaces that notifier, for one trainer, by one that does what it does *except*
the collective: it records the signal (``trainer.received_sigterm``) and forwards it to the launcher's processes.
Lightning's training loop already does the rest at points every rank reaches in the same order: at the start of
each batch it broadcasts rank 0's flag (so a signal to rank 0, or to every rank, ends every rank at the same batch
boundary, with ``SIGTERMException``), and at the end of each batch a rank that received the signal ends; a peer
then waiting in a collective with it fails as soon as its process has ended (gloo: "Connection closed by peer").
"""

from __future__ import annotations

import logging
import threading
from types import FrameType
from typing import Any

from lightning_hpc._compat import replace_sigterm_notifier

__all__ = ["sigterm_without_collective"]

log = logging.getLogger(__name__)


class _RecordSigterm:
    """Lightning's ``_sigterm_notifier_fn`` without the ``dist.broadcast`` it calls from the handler."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        connector = self.connector
        trainer = connector.trainer
        log.info(f"[rank: {trainer.local_rank}] Received SIGTERM: {signum}")  # Lightning's message
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the processes this one started (Lightning's subprocess launcher)
        connector.received_sigterm = True


def sigterm_without_collective(trainer: Any) -> None:
    """Make ``trainer``'s SIGTERM handling free of collectives (see the module docstring); call it before
    ``Trainer`` registers its signal handlers (a strategy's ``setup``).  Off the main thread nothing changes
    (Lightning installs no handler there)."""
    if threading.current_thread() is threading.main_thread():
        replace_sigterm_notifier(trainer, _RecordSigterm)
