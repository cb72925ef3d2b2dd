"""Packaging details pyproject.toml cannot express: conf/ and recipes/ live at the top of the repository and
travel inside the wheel as lightning_hpc/conf and lightning_hpc/recipes, so `lightning-hpc train` works from a
plain `pip install .` (lightning_hpc.cli.config_paths finds them in either place)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["lightning_hpc", "lightning_hpc.*"])
    + ["lightning_hpc.conf", "lightning_hpc.recipes"],
    package_dir={"lightning_hpc.conf": "conf", "lightning_hpc.recipes": "recipes"},
    package_data={"lightning_hpc.conf": ["*.yaml", "*/*.yaml"], "lightning_hpc.recipes": ["*.yaml"]},
)
