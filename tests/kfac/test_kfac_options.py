"""``KFACOptions`` is the one definition of the K-FAC settings: the preconditioner, the callback and the Hydra
config all take exactly its fields, and it validates them."""

from __future__ import annotations

import pathlib

import pytest
import torch
import yaml
from torch import nn

from lightning_hpc import KFAC
from lightning_hpc.kfac import (
    EigenMethod,
    InverseMethod,
    KFACOptions,
    KFACPreconditioner,
    Placement,
)

CONF = pathlib.Path(__file__).resolve().parents[2] / "conf" / "callbacks" / "kfac.yaml"


def test_hydra_config_keys_are_the_options_fields():
    keys = set(yaml.safe_load(CONF.read_text())["kfac"]) - {"_target_", "communicator"}
    assert keys == set(KFACOptions.field_names())


def test_hydra_config_defaults_are_the_options_defaults():
    conf = yaml.safe_load(CONF.read_text())["kfac"]
    defaults = KFACOptions()
    for name in KFACOptions.field_names():
        want = getattr(defaults, name)
        got = conf[name]
        if isinstance(want, tuple):
            got = tuple(got)
        assert got == want or (name == "decomposition_dtype" and got == "float32"), name


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"damping": -1.0}, "damping"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"inv_update_freq": 0}, "inv_update_freq"),
        ({"compute_method": "svd"}, "compute_method"),
        ({"placement": "random"}, "placement"),
        ({"decomposition_dtype": "float16"}, "decomposition_dtype"),
        ({"skip_layers": "("}, "skip_layers"),
        ({"conv_input_sample_fraction": 0.0}, "conv_input_sample_fraction"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"grad_worker_fraction": 0.0}, "grad_worker_fraction"),
        ({"grad_worker_fraction": 2}, "grad_worker_fraction"),
        ({"factor_dtype": "int8"}, "factor_dtype"),
        ({"inverse_dtype": "float64"}, "inverse_dtype"),
        ({"inverse_dtype": torch.int32}, "inverse_dtype"),
    ],
)
def test_options_validate_once_for_every_entry_point(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KFACOptions(**kwargs)
    with pytest.raises(ValueError, match=match):
        KFAC(**kwargs)
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(nn.Linear(2, 2), **kwargs)


def test_unknown_option_is_a_clear_error():
    with pytest.raises(TypeError, match="dampin"):
        KFAC(dampin=0.1)
    with pytest.raises(TypeError, match="dampin"):
        KFACPreconditioner(nn.Linear(2, 2), dampin=0.1)


def test_options_object_and_keywords_are_the_same_preconditioner():
    opts = KFACOptions(damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise")
    a = KFACPreconditioner.from_options(nn.Linear(3, 2), opts)
    b = KFACPreconditioner(
        nn.Linear(3, 2), damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise"
    )
    assert a.options == b.options == KFAC.from_options(opts).options
    assert KFAC(damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise").options == opts
    assert isinstance(a.method, InverseMethod) and isinstance(KFACPreconditioner(nn.Linear(3, 2)).method, EigenMethod)
    assert isinstance(a.placement_policy, Placement) and a.placement_policy.owner_preconditions
    assert a.factor_update_freq == 0 + max(1, 7 // 10) and a.decomposition_dtype == torch.float32


def test_preconditioner_takes_an_options_object_and_keyword_overrides():
    """The core is configured by one ``KFACOptions``; keywords named like its fields override them, validated by it."""
    opts = KFACOptions(damping=0.02, inv_update_freq=7)
    pre = KFACPreconditioner(nn.Linear(3, 2), opts, announce=False)
    assert pre.options is opts
    assert KFACPreconditioner(nn.Linear(3, 2), opts, damping=0.5, announce=False).options == opts.replace(damping=0.5)
    with pytest.raises(ValueError, match="damping"):
        KFACPreconditioner(nn.Linear(3, 2), opts, damping=-1.0)


@pytest.mark.parametrize("entry", [KFAC.__init__, KFACPreconditioner.__init__], ids=["KFAC", "KFACPreconditioner"])
def test_keyword_arguments_are_the_options_fields(entry):
    """Each option is a typed keyword argument with the dataclass's name, annotation and default: what
    LightningCLI, jsonargparse, Hydra and IDEs read (no ``**kwargs`` that hides them); nothing drifts."""
    import dataclasses
    import inspect

    params = inspect.signature(entry).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    defaults = KFACOptions()
    for f in dataclasses.fields(KFACOptions):
        assert f.name in params, f"{entry.__qualname__} lacks the option {f.name}"
        p = params[f.name]
        assert p.kind is p.KEYWORD_ONLY, f.name
        assert p.annotation == f.type, f"{f.name}: {p.annotation} here, {f.type} in KFACOptions"
        default = p.default
        if isinstance(getattr(defaults, f.name), tuple):
            default = tuple(default)
        assert default == getattr(defaults, f.name), f"{f.name}: default {p.default!r} here"


# -- callables of the step ------------------------------------------------------------------------------------------
def _train(steps: int = 5, **kw) -> tuple[KFACPreconditioner, nn.Module, list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, optimizer=opt, announce=False, **kw)
    decomposed: list[int] = []
    original = pre._update_decompositions

    def record() -> None:
        decomposed.append(pre.steps)
        original()

    pre._update_decompositions = record  # type: ignore[method-assign]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return pre, model, decomposed


def test_constant_callables_equal_constants():
    consts = {"damping": 0.05, "factor_decay": 0.9, "kl_clip": 0.01, "factor_update_freq": 1, "inv_update_freq": 2}
    _, want, want_dec = _train(**consts)
    _, got, got_dec = _train(**{k: (lambda step, v=v: v) for k, v in consts.items()})
    assert got_dec == want_dec == [0, 2, 4]
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.equal(a, b)


def test_callables_follow_the_step():
    pre, _, decomposed = _train(
        steps=5,
        damping=lambda s: 0.1 if s < 2 else 0.01,
        inv_update_freq=lambda s: 1 if s < 2 else 3,
        factor_update_freq=1,
        compute_method="inverse",
        kl_clip=None,
    )
    assert decomposed == [0, 1, 3]  # every step until step 2, then every third step
    # the inverses of step 3 carry step 3's damping (Eq 11), from the factors as they were then
    pre2, _, _ = _train(steps=4, damping=lambda s: 0.1 if s < 2 else 0.01, inv_update_freq=lambda s: 1 if s < 2 else 3,
                        factor_update_freq=1, compute_method="inverse", kl_clip=None)
    a = pre2.factors["0"]["A"].double()
    want = torch.linalg.inv(0.5 * (a + a.t()) + 0.01 * torch.eye(a.shape[0], dtype=torch.float64))
    torch.testing.assert_close(pre2.decompositions["0"]["inv_A"].double(), want, rtol=1e-4, atol=1e-5)
    assert pre.damping == 0.01


def test_a_callable_returning_a_bad_value_names_the_option_and_step():
    with pytest.raises(ValueError, match=r"damping must be >= 0, got -1.0 \(returned by its callable at step 0\)"):
        _train(steps=1, damping=lambda s: -1.0)
    with pytest.raises(ValueError, match="factor_decay must be in"):
        _train(steps=2, factor_update_freq=1, factor_decay=lambda s: 1.5)
