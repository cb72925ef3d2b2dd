"""Point-to-point messages posted as one batch, so that they are correct on NCCL as well as on gloo.

Two ranks that both send to and receive from each other (every halo and remap exchange) must not post their
``irecv`` / ``isend`` one by one on NCCL: each call is its own NCCL launch on the pair's stream, the receive
waits for the peer's send, which the peer queued behind its own receive, and both ranks wait forever (the
NCCL rule "send/receive to the same peer must be grouped or ordered").  ``torch.distributed.batch_isend_irecv``
launches a batch's operations together (``ncclGroupStart`` / ``ncclGroupEnd``); on gloo it posts them as before.
Within a batch, messages between the same two ranks match in the order they are posted (NCCL ignores tags): the
callers post at most one message per peer and direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["exchange"]


def exchange(
    sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]], group: Any
) -> list[Any]:
    """Post the receives ``(buffer, global source rank, tag)`` and the sends ``(tensor, global destination rank,
    tag)`` as one batch; returns the works to wait on (none when there is nothing to exchange)."""
    ops = [dist.P2POp(dist.irecv, buf, peer, group, tag) for buf, peer, tag in recvs]
    ops += [dist.P2POp(dist.isend, buf, peer, group, tag) for buf, peer, tag in sends]
    return list(dist.batch_isend_irecv(ops)) if ops else []
