import math

import numpy as np
import pytest
import torch

from lightning_hpc.data.mesh_tangling import CHANNELS, TARGET, generate_sample
from lightning_hpc.data.mesh_tangling.quality import METRIC_CAP, quad_quality

SIZE = 64  # matches the sample0 fixture (conftest.py)


def test_channels_are_lbanns_18_names():
    assert CHANNELS == (
        "Density", "Pressure", "VectorComp_AvgVelocity_R", "VolumeFractions_bubble", "aspectRatio", "conditionNumber",
        "distortion", "jacobian", "largestAngle", "oddy", "scaledJacobian", "shape", "shear", "skew", "smallestAngle",
        "stretch", "taper", "volume",
    )
    assert TARGET == "mask"


def test_deterministic_from_seed(sample0):
    again = generate_sample(seed=0, index=0, size=SIZE)
    other = generate_sample(seed=0, index=1, size=SIZE)
    for name in (*CHANNELS, TARGET):
        assert sample0[name].dtype == np.float32 and sample0[name].shape == (SIZE, SIZE)
        np.testing.assert_array_equal(sample0[name], again[name])
    assert not np.array_equal(sample0["Density"], other["Density"])


def test_labels_not_trivial_and_fields_finite(sample0):
    mask = sample0[TARGET]
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert 0 < mask.mean() < 0.5
    for name in CHANNELS:
        assert np.isfinite(sample0[name]).all(), name
    # The label is about the future: some cells are still valid now but tangle within the look-ahead.
    assert ((mask == 1) & (sample0["jacobian"] > 0)).any()
    # The bubble is there and the shock compressed the ambient gas (Density > 1 somewhere).
    assert sample0["VolumeFractions_bubble"].max() == 1.0 and sample0["VolumeFractions_bubble"].min() == 0.0
    assert sample0["Density"].max() > 1.2


def _mesh(points):
    """A 1x1-cell mesh from P0..P3 (counter-clockwise)."""
    p0, p1, p2, p3 = (torch.tensor(p, dtype=torch.float64) for p in points)
    return torch.stack([torch.stack([p0, p1]), torch.stack([p3, p2])])


def _metrics(points):
    return {k: float(v[0, 0]) for k, v in quad_quality(_mesh(points)).items()}


def test_verdict_square():
    h = 0.5
    m = _metrics([(0, 0), (h, 0), (h, h), (0, h)])
    expected = dict(aspectRatio=1, conditionNumber=1, distortion=1, jacobian=h * h, largestAngle=90, oddy=0,
                    scaledJacobian=1, shape=1, shear=1, skew=0, smallestAngle=90, stretch=1, taper=0, volume=h * h)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k


def test_verdict_rhombus_and_trapezoid():
    s3 = math.sqrt(3) / 2
    m = _metrics([(0, 0), (1, 0), (1.5, s3), (0.5, s3)])  # 60-degree rhombus of unit sides
    assert m["scaledJacobian"] == pytest.approx(s3)
    assert m["skew"] == pytest.approx(0.5)
    assert m["largestAngle"] == pytest.approx(120) and m["smallestAngle"] == pytest.approx(60)
    assert m["volume"] == pytest.approx(s3) and m["taper"] == pytest.approx(0, abs=1e-12)
    assert m["conditionNumber"] == pytest.approx(1 / s3)  # 0.5 (1 + 1) / sin(60)
    assert m["stretch"] == pytest.approx(math.sqrt(2) * 1 / math.sqrt(3))  # long diagonal sqrt(3)
    t = _metrics([(0, 0), (2, 0), (1.5, 1), (0.5, 1)])  # isosceles trapezoid
    assert t["taper"] == pytest.approx(0.5)  # |X12| = |(-2,0) + (1,0)| = 1 over min(|X1|, |X2|) = min(3, 2)
    assert t["volume"] == pytest.approx(1.5)


def test_verdict_tangled_quad():
    m = _metrics([(0, 0), (1, 0), (0.2, 0.2), (0, 1)])  # reflex corner at P2
    assert m["jacobian"] < 0 and m["scaledJacobian"] < 0
    assert m["shear"] == 0 and m["shape"] == 0
    assert m["conditionNumber"] == METRIC_CAP
    assert m["largestAngle"] > 180
