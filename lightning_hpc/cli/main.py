"""``lightning-hpc``: train recipes (Hydra) and the planning / data tools.

    lightning-hpc train [recipe=NAME] [key=value ...] [--multirun]
    lightning-hpc recipes
    lightning-hpc plan-kfac --model resnet50 --world-size 16 --placement balanced [--json]
    lightning-hpc plan-spatial recipe=mesh_tangling_1k --world-size 8 [--json]
    lightning-hpc mesh-data --size 1024 --samples 16 --out DIR
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "train_main", "SUBCOMMANDS"]

DEFAULT_RECIPE = "digits"

#: subcommand -> "module:function(argv)"; each tool lives with the technique it belongs to.
SUBCOMMANDS = {
    "train": "lightning_hpc.cli.main:train_main",
    "recipes": "lightning_hpc.cli.main:recipes_main",
    "plan-kfac": "lightning_hpc.cli.plan_kfac:main",
    "plan-spatial": "lightning_hpc.cli.plan_spatial:main",
    "mesh-data": "lightning_hpc.data.mesh_tangling.cli:main",
}


def _split_recipe(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    recipes, rest = [], []
    for arg in argv:
        if arg.startswith("recipe="):
            recipes = [r for r in arg.split("=", 1)[1].split(",") if r]
        else:
            rest.append(arg)
    return recipes or [DEFAULT_RECIPE], rest


#: Hydra flags that take a value (the value must stay next to its flag when arguments are reordered).
_HYDRA_VALUE_FLAGS = {
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "-i",
    "--info",
    "--experimental-rerun",
}


def _hydra_argv(args: Sequence[str], extra_overrides: Sequence[str]) -> list[str]:
    """Overrides first, flags after: Hydra's argparse accepts one run of positional overrides only."""
    overrides, flags = list(extra_overrides), []
    it = iter(args)
    for arg in it:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _HYDRA_VALUE_FLAGS and "=" not in arg:
                nxt = next(it, None)
                if nxt is not None:
                    flags.append(nxt)
        else:
            overrides.append(arg)
    return overrides + flags


def _quote_numeric_groups(args: Sequence[str], groups: set[str]) -> list[str]:
    """``precision=32`` -> ``precision='32'``: Hydra parses a bare number as an int, and a config group option
    must be a string ("Config group override must be a string or a list. Got int")."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and key.lstrip("+~") in groups:
            try:
                float(value)
            except ValueError:
                pass
            else:
                arg = f"{key}='{value}'"
        out.append(arg)
    return out


def _with_config_dir(args: list[str], conf: str) -> list[str]:
    """Add ``--config-dir conf`` (unless given): the groups then sit on Hydra's search path from the start, so
    ``--help`` lists them (a ``hydra.searchpath`` override only reaches composition, not the help text)."""
    if any(a in ("-cd", "--config-dir") or a.startswith("--config-dir=") for a in args):
        return args
    return [*args, f"--config-dir={conf}"]


def train_main(argv: Sequence[str]) -> int:
    """Compose ``recipes/<recipe>.yaml`` (primary config) with the groups in ``conf/`` and train.

    ``recipe=a,b --multirun`` sweeps over recipes too (one Hydra sweep per recipe).
    """
    import hydra

    from lightning_hpc.cli import hydra_launch
    from lightning_hpc.cli.config_paths import conf_dir, recipe_names, recipes_dir
    from lightning_hpc.cli.train import run
    from lightning_hpc.registry import register_strategies

    register_strategies()  # before configs are built (a recipe may name a strategy by its string)
    recipes, rest = _split_recipe(argv)
    known = recipe_names()
    for r in recipes:
        if r not in known:
            print(f"lightning-hpc: unknown recipe {r!r}; available: {', '.join(known)}", file=sys.stderr)
            return 2
    if len(recipes) > 1 and not any(a in ("-m", "--multirun") for a in rest):
        print("lightning-hpc: several recipes need --multirun", file=sys.stderr)
        return 2
    searchpath = f"hydra.searchpath=[file://{conf_dir()}]"
    rest = _quote_numeric_groups(rest, {p.name for p in conf_dir().iterdir() if p.is_dir()})
    for recipe in recipes:
        hydra_launch.install([f"recipe={recipe}", searchpath])
        task = hydra.main(config_path=str(recipes_dir()), config_name=recipe, version_base="1.3")(run)
        saved = sys.argv
        sys.argv = [saved[0], *_with_config_dir(_hydra_argv(rest, [searchpath]), str(conf_dir()))]
        try:
            task()
        finally:
            sys.argv = saved
    return 0


def recipes_main(argv: Sequence[str]) -> int:
    from lightning_hpc.cli.config_paths import recipe_names

    print("\n".join(recipe_names()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("subcommands: " + ", ".join(SUBCOMMANDS))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"lightning-hpc: unknown subcommand {name!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module_name, func = SUBCOMMANDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"lightning-hpc {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(module, func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
