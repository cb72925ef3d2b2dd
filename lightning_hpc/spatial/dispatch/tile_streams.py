"""A tile's part of a random tensor one process draws whole, drawn without holding the whole.

torch's CPU generator is an mt19937: it cannot jump ahead, so a rank must draw as many values as one process draws
for the whole tensor to leave the generator where one process leaves it, but it need keep only its tile's.  Its
serial draws (``uniform_``, ``bernoulli_``, ``random_(low, high)``) give element ``i`` (flat order of a contiguous
tensor)
the ``i``-th value of one stream, however the tensor is cut into pieces.  ``normal_`` on a contiguous tensor of
``n >= 16`` elements is not serial: it draws ``n`` uniforms, turns each block of 16 (elements ``16j..16j+15``)
into normals by Box-Muller (pairing element ``k`` with ``k + 8`` of the block), and, where ``n`` is not a
multiple of 16, draws 16 uniforms more and recomputes the last 16 elements from them.  A piece drawn on its own
therefore equals the whole draw's values only when it is whole blocks; :class:`_Stream` draws in whole blocks (a
block partly outside the tile is drawn and its other values dropped) and redraws the final block as torch does.

Each kind of draw is checked once per process against the whole draw on this build (:func:`draws_in_pieces`), with
the generator's state put back; a kind that fails keeps drawing the whole tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

#: values of ``k`` consecutive positions of the stream, as a 1-D tensor (drawing them from the generator)
Draw = Callable[[int], Tensor]


def _copy(values: Tensor, dest: Tensor) -> None:
    dest.copy_(values)


class _Stream:
    """The values one draw of ``n`` elements gives, read in flat order a piece at a time.

    ``draw(k)``: ``k`` values drawn on their own (a multiple of ``block`` at a position that is one, for the block
    draws); ``words(k)``: advance the generator as ``k`` positions do, keeping nothing (the uniforms of the
    positions whose values the block draw replaces, and any positions whose values no one needs); ``cap``: the most
    positions drawn at once when skipping."""

    def __init__(self, n: int, dtype: torch.dtype, draw: Draw, words: Callable[[int], object], block: int = 1,
                 cap: int = 1 << 16) -> None:
        self.n, self.dtype, self.draw, self.words, self.block = n, dtype, draw, words, block
        self.m = n - n % block  # the whole blocks; the values of positions m..n-1 come from the final block
        self.cap = max(cap - cap % block, block)
        self.pos = 0  # the next position the reader asks for
        self.drawn = 0  # the positions drawn from the generator: a multiple of block, at most m
        self.carry = torch.empty(0, dtype=dtype)  # the values of positions [drawn - len(carry), drawn)

    def _advance(self, target: int) -> None:
        while self.drawn < target:
            k = min(self.cap, target - self.drawn)
            self.words(k)
            self.drawn += k
        self.carry = self.carry[:0]

    def skip(self, k: int) -> None:
        """Pass over the next ``k`` positions (their block's start is kept drawable where a read follows)."""
        self.pos += k
        target = min(self.pos, self.m)
        target -= target % self.block
        if target > self.drawn:
            self._advance(target)

    def read(self, k: int) -> Tensor:
        """The values of the next ``k`` positions (those past the whole blocks are placeholders until
        :meth:`finish` gives them)."""
        c, e = self.pos, self.pos + k
        self.pos = e
        parts = []
        if c < self.drawn:
            start = self.drawn - len(self.carry)
            parts.append(self.carry[c - start : min(e, self.drawn) - start])
        lo, hi = max(c, self.drawn), min(e, self.m)
        if hi > lo:
            # from the start of the block holding lo (drawn <= lo < drawn + block) to the end of the block of hi-1
            end = -(-hi // self.block) * self.block
            buf = self.draw(end - self.drawn)
            parts.append(buf[lo - self.drawn : hi - self.drawn])
            self.carry = buf[hi - self.drawn :].clone()
            self.drawn = end
        if e > max(c, self.m):
            parts.append(torch.zeros(e - max(c, self.m), dtype=self.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def finish(self) -> Tensor | None:
        """Advance the generator to where the whole draw leaves it; the values of its last ``block`` positions
        where the final block was redrawn (``n`` not a multiple of ``block``), else None."""
        self._advance(self.m)
        if self.n == self.m:
            return None
        self.words(self.n - self.m)
        return self.draw(self.block)


def read_tile(shape: tuple[int, ...], index: tuple[slice, ...], stream: _Stream, out: Tensor,
              take: Callable[[Tensor, Tensor], object] = _copy) -> Tensor:
    """Fill ``out`` (contiguous, the tile's shape) with ``take(values, out's part)`` of this tile's part
    (``index``) of the values ``stream`` gives the whole tensor of ``shape``, and leave the generator where the
    whole draw leaves it.

    Along the dimensions before the first split one (``f``: samples, channels and the unsplit leading spatial
    dimensions) the tile holds every index, so the tensor is a sequence of blocks (one index of those dimensions,
    every later one whole). Small blocks are read several at a time, at most a quarter of the tile's elements per
    read, and the tile's part of each kept; a block larger than that is walked along dimension ``f``: the rows
    outside the tile skipped, the tile's rows read a quarter of the tile at a time (every later dimension whole).
    Besides ``out``, a read holds a quarter of the tile's elements (or one row of dimension ``f`` where that is
    larger) and two of the stream's blocks; the Python loop runs a few times per quarter."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    split = [d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])]
    stream.cap = max(out.numel() // 4, stream.block)
    if not split:
        take(stream.read(math.prod(shape)).view(shape), out)
    else:
        f = split[0]
        block = math.prod(shape[f:])
        blocks = out.view(-1, *out.shape[f:])  # one entry per block, each whole in the tile
        budget = max(out.numel() // 4, 1)
        if block <= budget:
            per = budget // block
            tile_part = (slice(None), *(slice(*bounds[d]) for d in range(f, len(shape))))
            for first in range(0, blocks.shape[0], per):
                n = min(per, blocks.shape[0] - first)
                take(stream.read(n * block).view(n, *shape[f:])[tile_part], blocks[first : first + n])
        else:
            a, b = bounds[f]
            inner = math.prod(shape[f + 1:])
            per = max(budget // inner, 1)  # rows of dimension f read at once
            later = (slice(None), *(slice(*bounds[d]) for d in range(f + 1, len(shape))))
            for i in range(blocks.shape[0]):
                stream.skip(a * inner)
                for row in range(a, b, per):
                    n = min(per, b - row)
                    take(stream.read(n * inner).view(n, *shape[f + 1:])[later], blocks[i][row - a : row - a + n])
                stream.skip((shape[f] - b) * inner)
    tail = stream.finish()
    if tail is not None:  # the whole draw's last len(tail) values, redrawn as one block: the tile's among them
        for j, q in enumerate(range(stream.n - len(tail), stream.n)):
            at = []
            for n in reversed(shape):
                q, i = divmod(q, n)
                at.append(i)
            at.reverse()
            if all(lo <= i < hi for i, (lo, hi) in zip(at, bounds)):
                take(tail[j], out[tuple(i - lo for i, (lo, _) in zip(at, bounds))])
    return out


def stream_parts(kind: str, dtype: torch.dtype, gen: torch.Generator | None = None, a: float | None = None,
                 b: float | None = None) -> tuple[Callable[[Tensor], Tensor], Draw, Callable[[int], object], int]:
    """``(whole(t), draw, words, block)`` of a kind of draw: ``whole`` fills a contiguous tensor of ``dtype`` as one
    process does, ``draw``/``words``/``block`` are what :class:`_Stream` takes for the same values.

    ``"uniform"``: ``uniform_(a, b)``; ``"normal"``: ``normal_(a, b)`` (mean, standard deviation), whose blocks of
    16 are made from uniforms of the dtype; ``"bernoulli"``: ``bernoulli_(a)`` with a scalar probability (one
    float64 uniform per element, whatever the dtype); ``"bernoulli_p"``: the uniforms of the dtype that
    ``bernoulli_(p)`` with probabilities ``p`` of the dtype compares with ``p`` (element ``i`` is ``u_i < p_i``;
    ``whole`` draws with probabilities ``linspace(0, 1)``); ``"randint"``: ``random_(a, b)``, integers in
    ``[a, b)`` (``randint_like``: one 32-bit word per element where ``b - a < 2**32``)."""
    def empty(k: int) -> Tensor:
        return torch.empty(k, dtype=dtype)

    def uniforms(k: int, of: torch.dtype = dtype) -> Tensor:
        return torch.empty(k, dtype=of).uniform_(generator=gen)

    if kind == "uniform":
        lo, hi = (0.0 if a is None else a), (1.0 if b is None else b)
        return (lambda t: t.uniform_(lo, hi, generator=gen), lambda k: empty(k).uniform_(lo, hi, generator=gen),
                uniforms, 1)
    if kind == "normal":
        mean, std = (0.0 if a is None else a), (1.0 if b is None else b)
        return (lambda t: t.normal_(mean, std, generator=gen), lambda k: empty(k).normal_(mean, std, generator=gen),
                uniforms, 16)
    if kind == "bernoulli":
        p = 0.5 if a is None else a
        return (lambda t: t.bernoulli_(p, generator=gen), lambda k: empty(k).bernoulli_(p, generator=gen),
                lambda k: uniforms(k, torch.float64), 1)
    if kind == "bernoulli_p":
        return (lambda t: t.bernoulli_(torch.linspace(0, 1, t.numel(), dtype=dtype).view(t.shape), generator=gen),
                uniforms, uniforms, 1)
    if kind == "randint":
        low, high = (0 if a is None else int(a)), (100 if b is None else int(b))

        def integers(k: int) -> Tensor:
            return empty(k).random_(low, high, generator=gen)

        return lambda t: t.random_(low, high, generator=gen), integers, integers, 1
    raise ValueError(f"unknown kind of draw {kind!r}")


def tile_of_draw(shape: tuple[int, ...], index: tuple[slice, ...], kind: str, dtype: torch.dtype,
                 gen: torch.Generator | None = None, a: float | None = None, b: float | None = None,
                 take: Callable[[Tensor, Tensor], object] = _copy, out: Tensor | None = None) -> Tensor:
    """This tile's part (``index``) of the kind of draw (:func:`stream_parts`) one process makes for a contiguous
    tensor of ``shape``, by :func:`read_tile` (into ``out``, a new tensor of ``dtype`` where None)."""
    _, draw, words, block = stream_parts(kind, dtype, gen, a, b)
    if out is None:
        out = torch.empty([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype=dtype)
    return read_tile(shape, index, _Stream(math.prod(shape), dtype, draw, words, block), out, take)


@functools.cache
def draws_in_pieces(kind: str, dtype: torch.dtype) -> bool:
    """Whether :func:`read_tile` with the kind's stream gives every tile of a tensor split along one or two
    dimensions its part of the whole draw bit for bit and leaves the generator where the whole draw does, on this
    build (checked once per kind and dtype, on sizes with and without a final partial block, the global
    generator's state put back)."""
    state = torch.get_rng_state()
    try:
        for shape in ((2, 3, 7, 11), (1, 2, 8, 8), (3, 37)):
            whole = stream_parts(kind, dtype)[0]
            torch.manual_seed(11)
            expected = whole(torch.empty(shape, dtype=dtype))
            end = torch.get_rng_state()
            for index in _probe_tiles(shape):
                torch.manual_seed(11)
                got = tile_of_draw(shape, index, kind, dtype)
                if kind == "bernoulli_p":
                    p = torch.linspace(0, 1, math.prod(shape), dtype=dtype).view(shape)[index]
                    got = (got < p).to(dtype)
                if not (torch.equal(got, expected[index]) and torch.equal(torch.get_rng_state(), end)):
                    return False
        return True
    finally:
        torch.set_rng_state(state)


def _probe_tiles(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Tiles of ``shape`` cut along its last dimension, its second-last, and both (uneven halves)."""
    d = len(shape)
    half = [slice(n // 2, n) for n in shape]
    return [(*(slice(None),) * (d - 1), half[-1]), (*(slice(None),) * (d - 2), half[-2], slice(None)),
            (*(slice(None),) * (d - 2), slice(0, shape[-2] // 2 + 1), half[-1])]
