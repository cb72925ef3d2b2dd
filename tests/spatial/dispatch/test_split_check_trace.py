"""The setup-time shape trace (``split_check.trace_shapes``) runs one sample through the user's model on the meta
device: afterwards the model holds the very same parameters, buffers and tensor attributes with the same values,
whatever the model shares, ties or parametrizes; a trace that fails names the layer and leaves the model as it
was (the strategy then warns and checks the split at the first step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from lightning_hpc.spatial.dispatch.split_check import ShapeTraceError, check_split, trace_shapes
from lightning_hpc.spatial.layout.halo_exchange import PartitionError


class SharedConv3d(nn.Module):
    """One convolution registered under two names (``conv`` and ``body.0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.body = nn.Sequential(self.conv)

    def forward(self, x):
        return self.body(x)


class SharedBlocks(nn.Module):
    """Blocks kept as attributes and again in a list (MONAI's DynUNet keeps its skip layers so), batch norm
    buffers included."""

    def __init__(self) -> None:
        super().__init__()
        self.input_block = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, stride=2), nn.BatchNorm2d(2))
        self.skip_layers = nn.ModuleList([self.input_block, self.down])

    def forward(self, x):
        return self.skip_layers[1](self.input_block(x))


class TiedWeights(nn.Module):
    """Two convolutions holding one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Parametrized(nn.Module):
    """Parametrizations (weight norm, spectral norm) and the hook forms, which store the computed ``weight`` as a
    plain attribute of the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Conv2d(2, 2, 3, padding=1))
        self.b = parametrizations.spectral_norm(nn.Conv2d(2, 2, 3, padding=1))
        self.c = nn.utils.weight_norm(nn.Conv2d(2, 2, 3, padding=1))
        self.d = nn.utils.spectral_norm(nn.Conv2d(2, 2, 3, padding=1))

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


class CachesOnFirstCall(nn.Module):
    """A layer that keeps a tensor made at its first call (a positional table sized by the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.ones_like(x[:1, :1])
        return self.conv(x) * self.table


MODELS = {
    "shared_conv3d": (SharedConv3d, (1, 8, 8, 8)),
    "shared_blocks": (SharedBlocks, (1, 8, 8)),
    "tied_weights": (TiedWeights, (2, 8, 8)),
    "parametrized": (Parametrized, (2, 8, 8)),
    "caches_on_first_call": (CachesOnFirstCall, (2, 8, 8)),
}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name, and every tensor attribute of every layer."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    for name, m in model.named_modules(remove_duplicate=False):
        out.update({f"{name}.{k}": v for k, v in vars(m).items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_trace_leaves_the_models_tensors_as_they_were(name):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(2, *shape)
    with torch.no_grad():
        before_out = model(x)  # the hook forms compute their weight, the caching layer fills its table
    before = {k: (v, v.detach().clone()) for k, v in _tensors(model).items()}
    model.train()

    shapes = trace_shapes(model, shape)

    assert any(out[2:] == shape[1:] for _, out in shapes.values()), shapes  # the trace ran through the model
    after = _tensors(model)
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())
    for k, (obj, value) in before.items():
        assert after[k] is obj, f"{k} was replaced (now on {after[k].device})"
        assert obj.device.type == "cpu" and torch.equal(obj, value), k
    assert all(m.training for m in model.modules())  # the modes are restored too
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), before_out)


def test_a_shared_layer_is_still_checked():
    model = SharedConv3d()
    model.conv = model.body[0] = nn.Conv3d(1, 2, 5, padding=2)  # a halo of 2 rows, tiles of 1
    with pytest.raises(PartitionError, match=r"layer 'conv' \(Conv3d\).*along W a tile of 1 rows is thinner"):
        check_split(model, (1, 8, 8, 4), (1, 1, 4))
    assert model.conv.weight.device.type == "cpu"


def test_a_float64_model_is_traced_in_its_dtype():
    model = nn.Sequential(nn.Conv2d(1, 2, 7, padding=3), nn.BatchNorm2d(2)).double()
    with pytest.raises(PartitionError, match=r"layer '0' \(Conv2d\).*halo"):
        check_split(model, (1, 8, 8), (4, 1))  # a float32 sample met float64 weights: torch's dtype error


class ReadsAValue(nn.Module):
    """Reads a value on the host (meta tensors hold none)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if y.abs().max().item() > 1e6:
            raise ValueError("diverged")
        return y


def test_a_failing_trace_names_the_layer_and_leaves_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 1, 1), ReadsAValue())
    before = {k: v for k, v in _tensors(model).items()}
    with pytest.raises(ShapeTraceError, match=r"failed in layer '1' \(ReadsAValue\): .*item"):
        trace_shapes(model, (1, 8, 8))
    after = _tensors(model)
    assert after.keys() == before.keys() and all(after[k] is v and v.device.type == "cpu" for k, v in before.items())


def test_lazy_layers_are_not_made_by_the_trace():
    model = nn.Sequential(nn.LazyConv2d(2, 3, padding=1))
    with pytest.raises(ShapeTraceError, match=r"layer '0' \(LazyConv2d\) has lazy parameters"):
        trace_shapes(model, (1, 8, 8))
    assert isinstance(model[0], nn.LazyConv2d) and model[0].has_uninitialized_params()


def test_a_cache_made_by_the_trace_is_made_again_at_the_first_call():
    torch.manual_seed(0)
    model = CachesOnFirstCall()
    trace_shapes(model, (2, 8, 8))
    assert not hasattr(model, "table")  # a meta table would fail the first real call
    x = torch.randn(1, 2, 8, 8)
    assert torch.equal(model(x), model.conv(x))
