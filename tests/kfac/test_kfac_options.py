"""``KFACOptions`` is the one definition of the K-FAC settings: the preconditioner, the callback and the Hydra
config all take exactly its fields, and it validates them."""

from __future__ import annotations

import pathlib

import pytest
import torch
import yaml
from torch import nn

from lightning_hpc import KFAC
from lightning_hpc.kfac import EigenMethod, InverseMethod, KFACOptions, KFACPreconditioner, Placement

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
    with pytest.raises(ValueError, match="fields of KFACOptions"):
        KFAC(dampin=0.1)
    with pytest.raises(ValueError, match="fields of KFACOptions"):
        KFACPreconditioner(nn.Linear(2, 2), dampin=0.1)


def test_options_object_and_keywords_are_the_same_preconditioner():
    opts = KFACOptions(damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise")
    a = KFACPreconditioner(nn.Linear(3, 2), opts)
    b = KFACPreconditioner(nn.Linear(3, 2), damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise")
    c = KFACPreconditioner(nn.Linear(3, 2), KFACOptions(damping=0.5), damping=0.02, inv_update_freq=7, compute_method="inverse", placement="layer_wise")
    assert a.options == b.options == c.options
    assert isinstance(a.method, InverseMethod) and isinstance(KFACPreconditioner(nn.Linear(3, 2)).method, EigenMethod)
    assert isinstance(a.placement_policy, Placement) and a.placement_policy.owner_preconditions
    assert a.factor_update_freq == 0 + max(1, 7 // 10) and a.decomposition_dtype == torch.float32
