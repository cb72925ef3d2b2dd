"""One layer's statistics captured since the last optimizer step (:class:`CapturedStatistics`): the sums of its
calls' input and output-gradient Grams (A's and G's, before the normalisation of the :mod:`.base` docstring's
scaling convention), their rows and samples, and the bookkeeping that pairs each call's input statistics with
its output gradient and counts samples once per forward pass. What the Grams are is the layer type's handler's
(:class:`~.base.LayerHandler`); the handler owns one of these (:attr:`~.base.LayerHandler.stats`).
"""

from __future__ import annotations

import torch

__all__ = ["CapturedStatistics"]


class CapturedStatistics:
    """The captured statistics of one layer (see the module docstring).

    A call's input statistics wait in :attr:`pending` under a token until its output gradient arrives (then both
    are committed, :meth:`take_call` and :meth:`commit`): a forward pass that is never backpropagated (a skipped
    training_step, a loss not used) leaves nothing. Samples are counted once per forward pass (its largest call),
    not once per call: a layer applied k times per sample is one layer at k positions (KFC's weight sharing), so
    its G equals the one of a single call on the k inputs stacked along a position dimension. A forward pass is
    the calls between two backward passes of the layer.
    """

    def __init__(self) -> None:
        #: most calls of the layer seen in one forward pass (> 1: shared weights, counted as positions)
        self.max_calls_per_forward = 0
        # never reset: a hook of a discarded forward pass must not match a later call's token
        self.next_token = 0
        self.forward_id = 0
        self.forget_pending()
        self.discard_committed()

    def forget_pending(self) -> None:
        """Forget the calls still waiting for their output gradient."""
        self.pending: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        #: a call of the current forward pass was opened and no backward pass of the layer has run since
        self.in_forward = False

    def discard_committed(self) -> None:
        """Forget the statistics of completed backward passes (calls still waiting for theirs are kept)."""
        self.a_sum: torch.Tensor | None = None
        self.a_rows = 0
        self.g_sum: torch.Tensor | None = None
        self.samples = 0
        self.g_samples = 0
        #: calls committed since the statistics were last discarded (tells whether they changed since a point)
        self.commits = 0
        #: dtype of the captured output gradients (float16 ones carry an AMP loss scale)
        self.g_dtype: torch.dtype | None = None
        self.forward_counted: dict[int, tuple[int, int]] = {}  # forward id -> (samples counted, calls committed)

    def open_call(self, stat: torch.Tensor, rows: int, samples: int) -> int:
        """Keep one call's input statistic (``rows`` rows of ``samples`` samples) until its output gradient comes;
        returns the call's token."""
        if not self.in_forward:  # first call since the last backward pass: a new forward pass
            self.in_forward = True
            self.forward_id += 1
        token = self.next_token
        self.next_token += 1
        self.pending[token] = (stat, rows, samples, self.forward_id)
        return token

    def latest_token(self) -> int:
        """The token of the latest call still waiting (-1: none)."""
        return max(self.pending, default=-1)

    def take_call(self, token: int | None) -> tuple[torch.Tensor, int, int, int] | None:
        """``(input statistic, rows, samples, forward id)`` of the call ``token`` (None: the latest), removed from
        :attr:`pending`; None when it was discarded since its forward pass. A backward pass ends the forward
        pass's calls."""
        self.in_forward = False
        return self.pending.pop(token if token is not None else self.latest_token(), None)

    def commit(self, samples: int, forward_id: int, g: torch.Tensor) -> None:
        """Count a call whose statistics were just added: its output gradient ``g`` and its ``samples``, once per
        forward pass."""
        self.g_samples += g.shape[0]
        self.g_dtype = g.dtype
        counted, calls = self.forward_counted.get(forward_id, (0, 0))
        if samples > counted:
            self.samples += samples - counted
        self.forward_counted[forward_id] = (max(samples, counted), calls + 1)
        self.max_calls_per_forward = max(self.max_calls_per_forward, calls + 1)
        self.commits += 1

    def add_input(self, stat: torch.Tensor, rows: int) -> None:
        """Add a call's input Gram (A's) of ``rows`` rows."""
        self.a_sum = stat if self.a_sum is None else self.a_sum + stat
        self.a_rows += rows

    def add_output(self, stat: torch.Tensor) -> None:
        """Add a call's output-gradient statistic (G's Gram, or a normalisation layer's Fisher blocks)."""
        self.g_sum = stat if self.g_sum is None else self.g_sum + stat

    def awaiting(self) -> bool:
        """Calls of the latest forward pass whose output gradient has not arrived yet (a layer called several
        times per forward pass receives one per call; a call whose output does not reach the loss never does)."""
        return any(p[3] == self.forward_id for p in self.pending.values())
