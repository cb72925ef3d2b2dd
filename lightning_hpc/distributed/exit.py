"""Destroy the default torch.distributed process group before the interpreter shuts down.

Lightning's DDP-style strategies leave the process group alive after ``Trainer.fit`` (a second ``fit`` reuses
it), and scripts rarely call ``destroy_process_group`` themselves.  With gloo that is a crash waiting to happen:
gloo's worker threads can still own finished ``AsyncWork`` objects whose tensors refer to Python objects, and
when the interpreter finalises, releasing them takes the GIL from a non-Python thread and the process dies with
``terminate called without an active exception`` (SIGABRT, exit code -6) after training succeeded.  torch does
not clean up for us (pytorch/pytorch#190489; the atexit fix in pytorch/pytorch#179291 was abandoned), and our
K-FAC and layered-SGD collectives are asynchronous, which makes the window more likely.

:func:`destroy_process_group_at_exit` registers one ``atexit`` handler that destroys the default group while the
interpreter is still whole.  It is registered by the components that need it, when they are created (every
lightning_hpc strategy, and the torch.distributed communicator K-FAC and layered SGD use), never by an import; a
user handler registered before that runs after it (``atexit`` runs handlers last-in first-out).
After an uncaught exception it does nothing: a peer may be stuck in a collective with this rank, and destroying
the group then could wait for gloo's timeout instead of letting the job end with the error.
"""

from __future__ import annotations

import atexit
import sys

__all__ = ["destroy_process_group_at_exit"]

_registered = False


def _destroy_default_group() -> None:
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return  # exiting on an uncaught exception (the interpreter sets sys.last_* before atexit runs)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exit cleanup must never turn a finished job into a failed one
            pass


def destroy_process_group_at_exit() -> None:
    """Register (once per process) the exit handler described in the module docstring."""
    global _registered
    if not _registered:
        atexit.register(_destroy_default_group)
        _registered = True
