"""A wheel built from the repo carries conf/ and recipes/, so `lightning-hpc train` works from `pip install .`."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_hpc.cli.config_paths import recipe_names

REPO = Path(__file__).resolve().parent.parent


def test_wheel_carries_configs_and_recipes(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("lightning_hpc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for recipe in recipe_names():
        assert f"lightning_hpc/recipes/{recipe}.yaml" in names
    assert "lightning_hpc/conf/base.yaml" in names and "lightning_hpc/conf/strategy/ddp.yaml" in names
    # installed copy (outside the checkout) finds its configs and composes a recipe
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = (
        "import lightning_hpc, lightning_hpc.cli.config_paths as c;"
        f"assert str(c.conf_dir()).startswith({str(target)!r}), c.conf_dir();"
        "print(' '.join(c.recipe_names()))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == recipe_names()


def _dev_sh_default(name: str) -> str:
    match = re.search(rf"^{name}=\${{{name}:-([^}}]+)}}$", (REPO / "scripts" / "dev.sh").read_text(), re.M)
    assert match, f"scripts/dev.sh sets no default {name}"
    return match.group(1)


def test_torch_range_is_the_tested_one():
    """pyproject.toml's torch requirement spans the releases CI tests: its lower bound is the release
    ``dev.sh torch-range oldest`` installs, it admits the one ``torch-range newest`` installs and no later minor
    release, the pinned default (``TORCH_SPEC``) lies inside, and ``_compat`` names the same range."""
    import lightning_hpc._compat as compat

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    (torch_req,) = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "dependencies"] if Requirement(r).name == "torch"]
    spec = torch_req.specifier
    oldest, newest = Version(_dev_sh_default("TORCH_OLDEST")), Version(_dev_sh_default("TORCH_NEWEST"))
    pinned = Version(_dev_sh_default("TORCH_SPEC").removeprefix("torch=="))
    lower = [s for s in spec if s.operator == ">="]
    assert [Version(s.version) for s in lower] == [oldest], f"{spec}: its lower bound is not TORCH_OLDEST={oldest}"
    assert oldest < newest and newest in spec and pinned in spec, (spec, oldest, newest, pinned)
    next_minor = Version(f"{newest.major}.{newest.minor + 1}.0")
    assert next_minor not in spec, f"{spec} admits {next_minor}, newer than the newest release tested ({newest})"
    assert f"torch {oldest.major}.{oldest.minor}-{newest.major}.{newest.minor}" in compat.__doc__
