"""Batched decompositions (:mod:`lightning_hpc.kfac.batched_decompositions`): the factors of one side length are
decomposed by one batched ``eigh`` / inverse, each equal to its own per-factor decomposition (float64: bitwise for
``eigh``, 1e-12 for the inverse), and a factor whose solve fails in the batch falls back on its own (float64 /
jitter) while the others of its batch keep the batched result."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_hpc.kfac import KFACPreconditioner

#: a diagonal entry no factor of the test model has: marks the factor whose solve the tests make fail
MARK = 12345.0
DAMPING = 0.03


class _Equal(nn.Module):
    """Several factors of each side length: three Linear 8 -> 8 (A 9x9, G 8x8), two 3x3 convolutions 2 -> 8
    without bias (A 18x18, G 8x8 beside the Linear G), two depthwise 3x3 convolutions (per-channel 9x9 blocks,
    beside the Linear A), BatchNorm (2x2 blocks) and an embedding (a diagonal A: decomposed on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 2)
        self.c1 = nn.Conv2d(2, 8, 3, padding=1, bias=False)
        self.d1 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.d2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 2, 1, bias=False)
        self.c3 = nn.Conv2d(2, 8, 3, padding=1, bias=False)
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).permute(0, 3, 1, 2)
        x = torch.tanh(self.d2(torch.tanh(self.d1(torch.tanh(self.c1(x))))))
        x = self.c3(torch.tanh(self.c2(self.bn(x)))).mean((2, 3))
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _fitted(method: str) -> KFACPreconditioner:
    torch.manual_seed(0)
    model = _Equal().double()
    pre = KFACPreconditioner(model, inv_update_freq=1, factor_update_freq=1, kl_clip=None, damping=DAMPING,
                             compute_method=method, decomposition_dtype="float64", announce=False)
    for _ in range(3):
        model.zero_grad()
        model(torch.randint(0, 10, (6, 5, 5))).pow(2).sum().backward()
        pre.step()
    return pre


def _per_factor(pre: KFACPreconditioner) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """Each factor decomposed on its own (the per-factor route)."""
    return {(h.name, kind): h.state.decompose(kind, pre.method, pre.damping, pre.decomposition_dtype,
                                              pre.inverse_dtype)
            for h in pre.handlers for kind in h.factor_forms()}


class _Solver:
    """Wraps ``torch.linalg.eigh`` / ``torch.linalg.inv``: records the batch size of each call, and with ``fail``
    makes the matrices marked with :data:`MARK` fail (``"nan"``: their results are NaN; ``"raise"``: the call
    raises, as LAPACK does for the whole batch when one matrix does not converge). The inverse sees the damped
    factor: its mark is ``MARK + damping`` (a jittered retry moves it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, fail: str | None = None) -> None:
        self.real = getattr(torch.linalg, name)
        self.fail = fail
        self.mark = MARK + DAMPING if name == "inv" else MARK
        self.calls: list[tuple[int, bool]] = []  # (matrices, includes a marked one)
        monkeypatch.setattr(torch.linalg, name, self)

    def __call__(self, x: torch.Tensor):
        marked = x[..., 0, 0] == self.mark if self.fail else torch.zeros(x.shape[:-2], dtype=torch.bool)
        self.calls.append((x[..., 0, 0].numel(), bool(marked.any())))
        if self.fail == "raise" and bool(marked.any()):
            raise torch.linalg.LinAlgError("forced failure")
        out = self.real(x)
        if self.fail == "nan":
            outs = out if isinstance(out, tuple) else (out,)
            for t in outs:
                t[marked] = float("nan")
        return out


def _count_decomposed(pre: KFACPreconditioner) -> int:
    return sum(1 for h in pre.handlers for form in h.factor_forms().values() if len(form.shape) > 1)


def _qdq(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (q * d.unsqueeze(-2)) @ q.transpose(-1, -2)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_batched_equal_per_factor_and_one_call_per_side(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pre = _fitted(method)
    expected = _per_factor(pre)
    solver = _Solver(monkeypatch, "eigh" if method == "eigen" else "inv")
    pre._update_decompositions()
    monkeypatch.undo()
    # one solver call per side length (8, 9, 18, 2 and the embedding's 2-wide G), not one per factor
    assert len(solver.calls) == 5 < _count_decomposed(pre), solver.calls
    for h in pre.handlers:
        for kind in h.factor_forms():
            for key, want in expected[(h.name, kind)].items():
                got = h.decompositions[f"{key}_{kind}"]
                assert got.shape == want.shape and got.is_contiguous()
            # the same LAPACK routine on the same matrix, but a batch member may round otherwise than the matrix alone
            # (threading for inv; for eigh on some CPUs the vector code taken depends on the alignment): equal to
            # rounding, the eigenvectors through what they are used for (Q diag(d) Q^T), since those of nearly equal
            # eigenvalues turn by rounding / gap
            got, want = ({k: h.decompositions[f"{k}_{kind}"] for k in expected[(h.name, kind)]},
                         expected[(h.name, kind)])
            if method == "eigen" and "q" in want:
                got, want = ({"qdq": _qdq(got["q"], got["d"]), "d": got["d"]},
                             {"qdq": _qdq(want["q"], want["d"]), "d": want["d"]})
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12 * want[key].abs().max().item(),
                                           msg=lambda m: f"{h.name} {kind} {key}: {m}")


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("fail", ["nan", "raise"])
def test_failing_factor_falls_back_alone(method: str, fail: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``l2``'s A (9x9, batched with ``l1``'s and ``l3``'s A and the depthwise layers' 9x9 blocks) fails in the
    batch: it alone takes the fallback (its jittered float64 retry succeeds: the jitter moves the mark), the others
    keep their exact per-factor decompositions, and the whole batch was one call."""
    pre = _fitted(method)
    bad = pre._by_name["l2"].state
    bad.factors["A"][0, 0] = MARK
    expected = _per_factor(pre)
    solver = _Solver(monkeypatch, "eigh" if method == "eigen" else "inv", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pre._update_decompositions()
    monkeypatch.undo()
    fallbacks = [str(w.message) for w in caught if "fallback" in str(w.message)]
    assert len(fallbacks) == 1 and "'l2.A'" in fallbacks[0], fallbacks
    batched = [n for n, marked in solver.calls if marked and n > 1]
    assert batched and batched[0] >= 3 + 2 * 8, solver.calls  # l1, l2, l3's A and 16 depthwise blocks together
    for h in pre.handlers:
        for kind in h.factor_forms():
            for key, want in expected[(h.name, kind)].items():
                got = h.decompositions[f"{key}_{kind}"]
                assert torch.isfinite(got).all(), (h.name, kind)
                if h.state is bad and kind == "A":
                    continue
                if method == "eigen":
                    assert torch.equal(got, want), (h.name, kind, key)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * want.abs().max().item())


def test_factor_failing_everything_keeps_its_previous_decomposition_alone() -> None:
    """A NaN factor fails every fallback: it keeps its previous decomposition, its batch-mates are updated."""
    pre = _fitted("eigen")
    bad, good = pre._by_name["l2"].state, pre._by_name["l1"].state
    before = {k: v.clone() for k, v in bad.decompositions.items()}
    good.factors["A"].mul_(2.0)
    want = _per_factor(pre)[("l1", "A")]
    assert not torch.equal(want["d"], good.decompositions["d_A"])
    bad.factors["A"][1, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match="'l2.A' failed even with jitter"):
        pre._update_decompositions()
    assert all(torch.equal(bad.decompositions[k], v) for k, v in before.items())
    assert torch.equal(good.decompositions["d_A"], want["d"]) and torch.equal(good.decompositions["q_A"], want["q"])
