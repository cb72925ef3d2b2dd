"""Random ops on a split activation (``rand_like``, ``randn_like``, ``randint_like``, ``torch.bernoulli``,
``Tensor.bernoulli_``,
``Tensor.uniform_``, ``Tensor.normal_``, ``F.alpha_dropout``, ``F.feature_alpha_dropout``): each tile's values
are, bit for bit, its part of what one process draws for the whole activation from the same generator state, the
generator ends where one process's draw leaves it, and no rank makes a tensor as large as the whole activation (on
the CPU, where the draw is checked to go in pieces).

The ranks are simulated in one process over many splits; two processes over gloo check the same at 2x1, 1x2 and
1x1x2 with the result gathered from the tiles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dropout_tiles import CASES as DROPOUT_CASES
from test_dropout_tiles import LargestTensor

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialTensor, split_tensor
from lightning_hpc.spatial.dispatch.autograd import _tile_index
from lightning_hpc.spatial.dispatch.tile_streams import _Stream, draws_in_pieces, read_tile, stream_parts
from lightning_hpc.spatial.layout.tiling import SpatialGrid, create_hybrid_layout

#: the dropout tests' splits (780 and 420 elements: 12 and 4 past a multiple of 16) and one of whole blocks of 16
CASES = {**DROPOUT_CASES, "1x2 whole blocks": ((2, 2, 8, 8), (1, 2))}


def _bernoulli_p(t: torch.Tensor, gen=None) -> torch.Tensor:
    """``bernoulli_`` with probabilities of the tensor's layout (split as it is)."""
    return t.clone().bernoulli_(t * 0 + 0.25 + (t > 0.5) * 0.5, generator=gen)


#: op name -> the op on a tensor of values in [0, 1) (the whole one, or its tile), with a generator or None
OPS = {
    "rand_like": lambda t, g: torch.rand_like(t, generator=g),
    "randn_like": lambda t, g: torch.randn_like(t, generator=g),
    "randn_like float64": lambda t, g: torch.randn_like(t, dtype=torch.float64, generator=g),
    "randint_like(high)": lambda t, g: torch.randint_like(t, 7, generator=g),
    "randint_like(low, high) int64": lambda t, g: torch.randint_like(t, -3, 50, dtype=torch.int64, generator=g),
    "randint_like(low=, high=) uint8": lambda t, g: torch.randint_like(t, low=2, high=255, dtype=torch.uint8,
                                                                          generator=g),
    "bernoulli(probabilities)": lambda t, g: torch.bernoulli(t, generator=g),
    "bernoulli(x, p)": lambda t, g: torch.bernoulli(t, 0.3, generator=g),
    "x.bernoulli()": lambda t, g: t.bernoulli(generator=g),
    "bernoulli_(p)": lambda t, g: t.clone().bernoulli_(0.7, generator=g),
    "bernoulli_(probabilities)": _bernoulli_p,
    "uniform_": lambda t, g: t.clone().uniform_(-1.5, 2.0, generator=g),
    "normal_": lambda t, g: t.clone().normal_(0.5, 3.0, generator=g),
    # the dropouts draw from the global generator (g is None here)
    "alpha_dropout": lambda t, g: F.alpha_dropout(t, 0.3, True),
    "alpha_dropout inplace": lambda t, g: F.alpha_dropout(t.clone(), 0.4, True, inplace=True),
    "feature_alpha_dropout": lambda t, g: F.feature_alpha_dropout(t, 0.5, True),
}
GLOBAL_ONLY = {"alpha_dropout", "alpha_dropout inplace", "feature_alpha_dropout"}


def _check_draws() -> None:
    """The once-per-process check of the draws (:func:`draws_in_pieces`, small tensors), made before any count."""
    for kind in ("uniform", "normal", "bernoulli", "bernoulli_p", "randint"):
        for dtype in (torch.float32, torch.float64):
            assert draws_in_pieces(kind, dtype), (kind, dtype)
    for dtype in (torch.int64, torch.uint8):
        assert draws_in_pieces("randint", dtype), ("randint", dtype)


@pytest.fixture(autouse=True)
def _checked_once() -> None:
    _check_draws()


def _state(gen):
    return (torch.get_rng_state() if gen is None else gen.get_state()).clone()


def _compare(op: str, x: torch.Tensor, grid: SpatialGrid, sdims: tuple[int, ...], use_gen: bool, seed: int = 5):
    """(one process's draw, its generator state after, this tile's draw, its state after, the largest tensor the
    tile's draw made, the tile's elements)."""
    gen = torch.Generator().manual_seed(seed) if use_gen else torch.manual_seed(seed) and None
    expected = OPS[op](x, gen)
    end = _state(gen)
    index = _tile_index(x.shape, sdims, grid)
    tile = split_tensor(x[index].clone(), grid, x.shape, sdims)
    gen = torch.Generator().manual_seed(seed) if use_gen else torch.manual_seed(seed) and None
    with LargestTensor() as largest:
        out = OPS[op](tile, gen)
    assert isinstance(out, SpatialTensor), f"{op}: not a tile"
    return expected[index], end, out.local(), _state(gen), largest.numel, tile.local().numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", list(CASES))
def test_each_tile_draws_its_part_of_one_process_draw_and_holds_no_whole_one(case, op, dtype):
    shape, parts = CASES[case]
    x = torch.rand(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    sdims = tuple(range(2, len(shape)))
    for rank in range(math.prod(parts)):
        grid = SpatialGrid(parts=parts, ranks=list(range(math.prod(parts))), group=None, local_rank=rank)
        for use_gen in (False,) if op in GLOBAL_ONLY else (False, True):
            want, end, got, state, largest, tile_numel = _compare(op, x, grid, sdims, use_gen)
            what = f"{case} {op} tile {grid.index} ({'own generator' if use_gen else 'global generator'})"
            assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: not one process's values"
            assert torch.equal(state, end), f"{what}: the generator is not where one process's draw leaves it"
            # the tile's values (and, for bernoulli, its probabilities' uniforms); pieces of a quarter of the tile
            assert largest <= tile_numel < x.numel(), (what, largest, tile_numel, x.numel())


def test_bernoulli_passes_its_probabilities_a_zero_gradient_as_one_process():
    shape, parts = CASES["1x2"]
    grid = SpatialGrid(parts=parts, ranks=[0, 1], group=None, local_rank=1)
    index = _tile_index(shape, (2, 3), grid)
    w = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    torch.manual_seed(4)
    torch.bernoulli(w * 1).sum().backward()
    expected = w.grad
    w.grad = None
    torch.manual_seed(4)
    out = torch.bernoulli(split_tensor(w[index], grid, shape, (2, 3)) * 1)
    assert out.requires_grad
    out.local().sum().backward()
    assert expected is not None and w.grad is not None and torch.equal(w.grad, expected)


def test_normals_in_pieces_need_whole_blocks():
    """torch's CPU ``normal_`` pairs uniforms within blocks of 16 of the whole tensor and redraws its final partial
    block: pieces of any other size give other values, the stream's whole blocks give torch's."""
    shape, index = (3, 37), (slice(None), slice(20, 37))  # 111 elements: 6 whole blocks and 15 more
    assert draws_in_pieces("normal", torch.float32)
    torch.manual_seed(0)
    expected = torch.randn(shape)
    torch.manual_seed(0)
    naive = torch.cat([torch.randn(37) for _ in range(3)]).view(shape)  # one row at a time
    assert not torch.equal(naive[index], expected[index])
    whole, draw, words, block = stream_parts("normal", torch.float32, a=0.0, b=1.0)
    torch.manual_seed(0)
    got = read_tile(shape, index, _Stream(111, torch.float32, draw, words, block), torch.empty(3, 17))
    assert torch.equal(got, expected[index])


def _in_processes(rank: int, world: int, dtype: torch.dtype) -> list[str]:
    _check_draws()
    fails = []
    for parts, shape in (((2, 1), (2, 3, 13, 10)), ((1, 2), (2, 3, 13, 10)), ((1, 1, 2), (2, 2, 5, 6, 7))):
        grid = create_hybrid_layout(parts).grid
        sdims = tuple(range(2, len(shape)))
        x = torch.rand(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
        for op in OPS:
            torch.manual_seed(3)
            expected = OPS[op](x, None)
            end = torch.get_rng_state()
            index = _tile_index(shape, sdims, grid)
            torch.manual_seed(3)
            with LargestTensor() as largest:
                out = OPS[op](split_tensor(x[index].clone(), grid, shape, sdims), None)
            n = out.local().numel()
            what = f"rank {rank} {parts} {op}"
            if not torch.equal(out.local(), expected[index]):
                fails.append(f"{what}: the tile is not its part of one process's draw")
            if not torch.equal(torch.get_rng_state(), end):
                fails.append(f"{what}: the generator is not where one process's draw leaves it")
            if largest.numel > n:
                fails.append(f"{what}: a tensor of {largest.numel} elements (the tile has {n})")
            if not torch.equal(out.full(), expected):  # the tiles gathered over the group
                fails.append(f"{what}: the gathered tiles are not one process's draw")
    return fails


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_two_processes_draw_one_process_values(dtype):
    failures = [f for r in run_in_processes(_in_processes, 2, dtype, timeout_s=300, collective_timeout_s=120)
                for f in r]
    assert not failures, "\n".join(failures)
