"""A wheel built from the repo carries conf/ and recipes/, so `lightning-hpc train` works from `pip install .`."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
