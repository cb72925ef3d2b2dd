"""The docs run as written: every ```python block of README.md and docs/*.md and every command line of their
```bash blocks that invokes ``lightning-hpc`` / ``python -m lightning_hpc`` is executed here as printed, or, where
it cannot run on a CPU machine, is listed below with the reason and checked as far as it can be (Python blocks
compiled, ``train`` commands composed by Hydra with ``--cfg=job``, so every key they override exists).

The only substitutions are the ones the text announces or a reader makes: ``trainer.fast_dev_run=true`` appended
to a training command, an output folder of the reader's choosing, the optional ``[--json]`` of a usage line taken,
and the reader's own objects (``model``, ``optimizer``, ``loader``) given to a fragment that names them.
A block or command added to the docs and not classified here fails :func:`test_every_snippet_is_classified`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_hpc.cli.main import SUBCOMMANDS
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_INVOKES = re.compile(rf"(?:^|\s)(?:lightning-hpc|-m lightning_hpc)\s+({'|'.join(SUBCOMMANDS)})(?:\s|$)")


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int  # first line of the block's body
    lang: str
    text: str


def _blocks() -> list[Block]:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w*)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            out.append(Block(str(path.relative_to(REPO)), i + 2, fence.group(1), "\n".join(lines[i + 1 : j])))
            i = j + 1
    return out


def _python_blocks() -> list[Block]:
    return [b for b in _blocks() if b.lang == "python"]


def _commands() -> list[tuple[str, int, str]]:
    """(file, line, command) for each logical line (backslash continuations joined) that invokes the CLI."""
    out = []
    for b in _blocks():
        if b.lang not in ("bash", "sh"):
            continue
        lines, k = b.text.splitlines(), 0
        while k < len(lines):
            start, line = k, lines[k]
            while line.rstrip().endswith("\\") and k + 1 < len(lines):
                k += 1
                line = line.rstrip()[:-1] + " " + lines[k].strip()
            k += 1
            if _INVOKES.search(line.split(" #")[0]):
                out.append((b.file, b.line + start, " ".join(line.split(" #")[0].split())))
    return out


#: what the reader's shell, launcher or earlier run supplies: a run folder, the launcher's variables, no script args
PLACEHOLDERS = {
    "<run>": "2026-01-01_00-00-00",
    "$SLURM_NTASKS_PER_NODE": "4",
    "$SLURM_JOB_NUM_NODES": "2",
    "$SLURM_JOB_ID": "42",
    "$JOB_ID": "42",
}


def _argv(command: str) -> list[str]:
    """The arguments after ``lightning-hpc`` / ``-m lightning_hpc``; ``[--opt]`` (optional in a usage line) taken,
    PLACEHOLDERS filled in."""
    tokens = shlex.split(command)
    for i, tok in enumerate(tokens):
        if tok == "lightning-hpc" or (tok == "lightning_hpc" and tokens[i - 1] == "-m"):
            argv = [t[1:-1] if t.startswith("[") and t.endswith("]") else t for t in tokens[i + 1 :] if t != "$@"]
            for placeholder, value in PLACEHOLDERS.items():
                argv = [a.replace(placeholder, value) for a in argv]
            assert not any("$" in a or "<" in a for a in argv), f"fill in a placeholder of {command!r}"
            return argv
    raise AssertionError(f"no lightning-hpc invocation in {command!r}")


# --------------------------------------------------------------------------------------------- Python blocks

#: the reader's own objects, for fragments that use them without defining them (a small model and its loop)
READER = """
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from lightning_hpc.models import small_cnn
torch.manual_seed(0)
model = small_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
epochs = 2
loader = [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(3)]
"""

#: (file, a line of the block, how it is checked, why / what it must show). "run": executed in this process with
#: READER first; "script": written to train.py and run with ``python train.py`` (Lightning starts the other ranks),
#: slow; "compile": compiled only, for the reason given.
PYTHON = [
    ("README.md", "max_epochs=5, strategy=\"layered_sgd\"", "script", "a complete script: 5 epochs on 2 processes"),
    ("README.md", "KFAC(damping=0.001, factor_update_freq=10", "run", "the callback and the plain-PyTorch form"),
    ("README.md", "num_nodes=16, strategy=\"layered_sgd\"", "compile", "its first line asks for 16 nodes x 8 GPUs"),
    ("README.md", "HybridParallelStrategy(head=\"model.classifier\"", "compile",
     "4 ranks of AlexNet on 224^2 images at batch 128: too large for a CPU test (tests/hybrid_fc trains it small)"),
    ("README.md", "input_shape=(18, 2048, 2048)", "compile", "2 nodes x 4 devices and a generated 2048^2 data set"),
    ("README.md", "MultigridStrategy(layer_parallel_size=2", "script", "a complete script: 3 epochs on 4 processes"),
    ("docs/cluster.md", "SimNodes(2)", "compile", "network namespaces need root: the cluster tier runs it"),
    ("docs/horovod.md", "small_cnn(1, 10)", "compile", "needs Horovod (the horovod tier runs the strategy)"),
    ("docs/horovod.md", "HorovodCommunicator under", "compile", "needs Horovod"),
    ("docs/horovod.md", "get_communicator(\"horovod\")", "compile", "needs Horovod and a process set"),
    ("docs/hybrid_fc.md", "fc_update=\"per_step\"", "compile", "asks for 4 GPUs; datamodule=... is the reader's"),
    ("docs/hybrid_fc.md", "parallelize_head(model, head=None", "compile", "runs on every rank of a process group"),
    ("docs/hybrid_fc.md", "device=\"cuda\"", "compile", "shards on CUDA, inside a process group"),
    ("docs/kfac.md", "precond.set_epoch(epoch)", "run", "the plain-PyTorch loop on the reader's model"),
    ("docs/kfac.md", "precond.no_sync()", "compile", "needs the reader's DDP model (model.no_sync())"),
    ("docs/kfac.md", "damping_decay_epochs=[25, 35]", "run", "builds the Trainer with the paper's schedule"),
    ("docs/kfac.md", "g_pre, d_pre = ", "run", "a GAN's plain loop, one preconditioner per optimizer"),
    ("docs/layered_sgd.md", "procs_per_node=2))", "compile", "its second Trainer asks for 16 nodes x 8 GPUs"),
    ("docs/layered_sgd.md", "build_layered_groups(procs_per_node=2)", "compile", "runs on every rank of a group"),
    ("docs/mesh_tangling.md", "MeshTanglingDataModule(on_the_fly=True, size=128", "run", "one epoch on one CPU"),
    ("docs/multigrid.md", "net.steps = MultigridODEBlock", "run", "prints the residual norm of every cycle"),
    ("docs/multigrid.md", "ode_resnet(num_steps=64)), datamodule=...", "compile", "datamodule=... is the reader's"),
    ("docs/spatial.md", "create_hybrid_layout((2, 2))", "compile", "runs on every rank of a 4-rank grid"),
    ("docs/spatial.md", "trainer.fit(module, datamodule=dm)", "compile", "asks for 2 nodes x 4 GPUs"),
]


def _entry(block: Block) -> tuple[str, str, str, str]:
    found = [e for e in PYTHON if e[0] == block.file and e[1] in block.text]
    assert len(found) == 1, f"{block.file}:{block.line}: python block matches {len(found)} entries of PYTHON"
    return found[0]


def _block(marker: str, file: str = "README.md") -> Block:
    (block,) = [b for b in _python_blocks() if marker in b.text and b.file == file]
    return block


def test_every_snippet_is_classified():
    """A new block or command in the docs must be listed here (run, or compiled / composed with a reason), and
    every entry must still name a block of the docs."""
    blocks = _python_blocks()
    for block in blocks:
        _entry(block)
    for file, marker, _, _ in PYTHON:
        assert any(b.file == file and marker in b.text for b in blocks), f"{file}: no python block has {marker!r}"
    commands = _commands()
    assert len(commands) >= 40, commands  # the extraction finds the docs' commands
    for file, line, command in commands:
        if _argv(command)[0] != "train":
            assert command in TOOLS, f"{file}:{line}: list {command!r} in TOOLS"
    listed = {c for _, _, c in commands}
    for command in (*TOOLS, *TRAIN_RUNS, *TRAIN_COMPOSE_ONLY):
        assert command in listed, f"{command!r} is no longer in the docs"


@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: f"{b.file}:{b.line}")
def test_python_block_compiles(block):
    compile(block.text, f"{block.file}:{block.line}", "exec")


def _exec(file: str, marker: str, capsys) -> dict:
    block = _block(marker, file)
    assert _entry(block)[2] == "run"
    scope: dict = {"__name__": "__docs__"}
    exec(compile(READER, "reader", "exec"), scope)
    before = {k: v.detach().clone() for k, v in scope["model"].state_dict().items()}
    exec(compile(block.text, f"{block.file}:{block.line}", "exec"), scope)
    scope["_model_before"] = before
    scope["_out"] = capsys.readouterr().out
    return scope


def test_readme_kfac_block(capsys):
    from lightning_hpc import KFAC, KFACPreconditioner

    scope = _exec("README.md", "KFAC(damping=0.001, factor_update_freq=10", capsys)
    (callback,) = [c for c in scope["trainer"].callbacks if isinstance(c, KFAC)]
    assert callback.options.damping == 0.001 and callback.options.inv_update_freq == 100
    assert isinstance(scope["precond"], KFACPreconditioner) and scope["precond"].options.damping == 0.003


def test_kfac_plain_pytorch_loop_preconditions_and_steps(capsys):
    scope = _exec("docs/kfac.md", "precond.set_epoch(epoch)", capsys)
    assert scope["precond"].steps == scope["epochs"] * len(scope["loader"])
    changed = [k for k, v in scope["model"].state_dict().items() if not v.equal(scope["_model_before"][k])]
    assert changed, "the loop did not update the model"


def test_kfac_trainer_block_sets_the_paper_schedule(capsys):
    from lightning_hpc import KFAC

    scope = _exec("docs/kfac.md", "damping_decay_epochs=[25, 35]", capsys)
    (callback,) = [c for c in scope["trainer"].callbacks if isinstance(c, KFAC)]
    assert callback.options.inv_update_freq == 500 and list(callback.options.damping_decay_epochs) == [25, 35]


def test_kfac_gan_block_steps_one_preconditioner_per_optimizer(capsys):
    scope = _exec("docs/kfac.md", "g_pre, d_pre = ", capsys)
    g_pre, d_pre = scope["g_pre"], scope["d_pre"]
    assert [h.name for h in g_pre.handlers] == ["generator.0", "generator.2"]
    assert [h.name for h in d_pre.handlers] == ["discriminator.0", "discriminator.2"]
    assert g_pre.steps == d_pre.steps == 3


def test_multigrid_block_prints_the_residual_history(capsys):
    scope = _exec("docs/multigrid.md", "net.steps = MultigridODEBlock", capsys)
    forward, backward = scope["net"].steps.forward_history, scope["net"].steps.backward_history
    assert len(forward) >= 2 and len(backward) >= 2  # 2 cycles each (and the initial residual where recorded)
    assert scope["_out"].strip() == f"{forward} {backward}"


@pytest.mark.slow
def test_mesh_tangling_block_trains_one_epoch(capsys):
    scope = _exec("docs/mesh_tangling.md", "MeshTanglingDataModule(on_the_fly=True, size=128", capsys)
    module = scope["module"]
    assert module.trainer.current_epoch == 1 and module.trainer.state.finished


@pytest.mark.slow
@pytest.mark.parametrize(
    ("marker", "epochs"),
    [("max_epochs=5, strategy=\"layered_sgd\"", 5), ("MultigridStrategy(layer_parallel_size=2", 3)],
)
def test_readme_script_runs_with_python(tmp_path, marker, epochs):
    """``python train.py`` in a fresh folder: exit code 0 and a checkpoint of the last of the epochs it asks for."""
    block = _block(marker)
    assert _entry(block)[2] == "script"
    (tmp_path / "train.py").write_text(block.text + "\n")
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**_clean_env(), "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpts = [p.name for p in (tmp_path / "lightning_logs").rglob("*.ckpt")]
    assert any(name.startswith(f"epoch={epochs - 1}-") for name in ckpts), ckpts


def _clean_env() -> dict[str, str]:
    import os

    from tests.conftest import LAUNCH_VARS

    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}


# --------------------------------------------------------------------------------------------- commands

#: ``train`` commands run with ``trainer.fast_dev_run=true`` appended (slow tier): the ones a CPU runs as printed
TRAIN_RUNS = [
    "lightning-hpc train",
    "lightning-hpc train optimizer.lr=0.05 trainer.max_epochs=2",
    "lightning-hpc train --multirun optimizer.lr=0.01,0.05,0.1",
    "lightning-hpc train recipe=digits strategy=layered_sgd",
    "lightning-hpc train recipe=digits strategy=layered_sgd strategy.procs_per_node=1",
    "lightning-hpc train callbacks=kfac callbacks.kfac.placement=round_robin",
    "lightning-hpc train callbacks=kfac callbacks.kfac.grad_worker_fraction=0.5",
    "lightning-hpc train recipe=digits_odenet",
    "lightning-hpc train recipe=digits_odenet trainer.fast_dev_run=true",
    "lightning-hpc train recipe=digits_odenet strategy.mode=pm",
    "lightning-hpc train recipe=mesh_tangling_1k trainer.fast_dev_run=true 'input_shape=[18,128,128]' "
    "data.train_samples=2 data.val_samples=1 trainer.accelerator=cpu trainer.devices=2",
    "lightning-hpc train recipe=digits strategy=spatial strategy.spatial_parts=[2,1] trainer.devices=2 "
    "trainer.fast_dev_run=true",
]

#: ``train`` commands composed only (every other one is composed as well), with the reason they do not run here
TRAIN_COMPOSE_ONLY = {
    "lightning-hpc train recipe=resnet_cifar": "ResNet-32 at batch 128 (tests/test_cli.py runs it small)",
    "lightning-hpc train recipe=resnet_imagenet data=synthetic trainer.fast_dev_run=true":
        "ResNet-50 on 224^2 images at the paper's batch (tests/test_cli.py runs the recipe small)",
}


def _train_commands() -> list[tuple[str, int, str]]:
    return [c for c in _commands() if _argv(c[2])[0] == "train"]


@pytest.mark.parametrize("where", _train_commands(), ids=lambda c: f"{c[0]}:{c[1]}")
def test_train_command_composes(where, cli_in_process):
    """Every ``train`` command as printed (GPU, cluster and Horovod launches included) composes: Hydra knows every
    group and key it names (``--cfg=job`` prints the config and runs nothing)."""
    file, line, command = where
    argv = _argv(command)
    if any(a.startswith("hydra/launcher=submitit") for a in argv):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra is not installed")
    for job in _sweep_jobs(argv):
        proc = cli_in_process(*job, "--cfg=job", check=False)
        assert proc.returncode == 0, f"{file}:{line}: {command}\n{proc.stdout[-3000:]}"
        assert "trainer:" in proc.stdout and "model:" in proc.stdout, proc.stdout[-2000:]


def _sweep_jobs(argv: list[str]) -> list[list[str]]:
    """A ``--multirun`` command as its jobs (Hydra prints one config at a time): each value of each swept key."""
    if "--multirun" not in argv:
        return [argv]
    argv = [a for a in argv if a != "--multirun"]
    swept = [i for i, a in enumerate(argv) if "=" in a and "," in a.split("=", 1)[1] and "[" not in a]
    jobs = []
    for i in swept:
        key, values = argv[i].split("=", 1)
        for value in values.split(","):
            job = [f"{a.split('=', 1)[0]}={a.split('=', 1)[1].split(',')[0]}" if j in swept else a
                   for j, a in enumerate(argv)]
            job[i] = f"{key}={value}"
            jobs.append(job)
    return jobs or [argv]


@pytest.mark.slow
@pytest.mark.parametrize("command", TRAIN_RUNS)
def test_train_command_runs_with_fast_dev_run(command, cli_in_process):
    argv = _argv(command)
    if "trainer.fast_dev_run=true" not in argv:
        argv.append("trainer.fast_dev_run=true")
    proc = cli_in_process(*argv)
    assert proc.returncode == 0
    assert "metrics" in proc.stdout.lower(), proc.stdout[-2000:]  # the final summary the README promises


def _check_recipes(out: str, _tmp: Path) -> None:
    from lightning_hpc.cli.config_paths import recipe_names

    for name in recipe_names():
        assert name in out, (name, out)


def _check_kfac_plan(out: str, _tmp: Path) -> None:
    assert re.search(r"K-FAC placement plan: resnet50 \(\d+ layers, \d+ factors\), world size 16", out), out


def _check_kfac_plan_json(out: str, _tmp: Path) -> None:
    plan = json.loads(out)
    assert (plan["model"], plan["placement"], plan["world_size"]) == ("resnet50", "round_robin", 16), out[:500]


def _check_plan_spatial(out: str, _tmp: Path) -> None:
    assert "predicted time per mini-batch" in out or "spatial parts" in out, out[-2000:]


def _check_plan_spatial_json(out: str, _tmp: Path) -> None:
    plan, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])  # progress lines (stderr) follow
    assert plan["world_size"] == 8 and plan["predicted_step_time_s"] > 0, out[-2000:]


def _check_mesh_data(out: str, tmp: Path) -> None:
    announced = int(re.search(r"= ([\d,]+) bytes", out).group(1).replace(",", ""))
    assert announced == sum(p.stat().st_size for p in tmp.rglob("*.bin")), out


#: every other command: (tier, check of its output) or ("not run", reason). An ``--out`` folder is the reader's
#: choice: it is replaced by one under the test's temporary folder.
TOOLS = {
    "lightning-hpc recipes": ("default", _check_recipes),
    "lightning-hpc plan-kfac --model resnet50 --world-size 16 --placement balanced": ("default", _check_kfac_plan),
    "lightning-hpc plan-kfac --model resnet50 --world-size 16 --placement round_robin [--json]":
        ("default", _check_kfac_plan_json),
    "lightning-hpc plan-kfac --model resnet50 --world-size 16 --grad-worker-fraction 0.25 --grad-worker-fraction 1":
        ("default", _check_kfac_plan),
    "lightning-hpc plan-spatial recipe=mesh_tangling_1k --world-size 8": ("slow", _check_plan_spatial),
    "lightning-hpc plan-spatial recipe=mesh_tangling_1k --world-size 8 --per-layer": ("slow", _check_plan_spatial),
    "lightning-hpc plan-spatial recipe=mesh_tangling_1k --world-size 8 --json": ("slow", _check_plan_spatial_json),
    "lightning-hpc plan-spatial recipe=volumes_unet3d --world-size 4": ("slow", _check_plan_spatial),
    "lightning-hpc mesh-data --size 1024 --samples 16 --out data/mesh1k --workers auto": ("slow", _check_mesh_data),
    "lightning-hpc mesh-data --size 1024 --samples 16 --out /data/mesh1k --workers auto":
        ("not run", "README's command (run above) with another --out"),
    "lightning-hpc mesh-data --size 2048 --samples 64 --out /data/mesh2k":
        ("not run", "20 GB and about 17 minutes: its arguments are parsed and its announced size checked"),
}


def _tool_params(tier: str) -> list:
    marks = [pytest.mark.slow] if tier == "slow" else []
    return [pytest.param(c, marks=marks, id=c) for c, (t, _) in TOOLS.items() if t == tier]


@pytest.mark.parametrize("command", _tool_params("default") + _tool_params("slow"))
def test_tool_command_runs(command, cli_in_process, tmp_path):
    argv = _argv(command)
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp_path / "out")
    proc = cli_in_process(*argv)
    TOOLS[command][1](proc.stdout, tmp_path)


def test_commands_not_run_are_checked_as_far_as_they_can_be():
    from lightning_hpc.data.mesh_tangling.cli import _parser, planned_bytes

    command = "lightning-hpc mesh-data --size 2048 --samples 64 --out /data/mesh2k"
    assert TOOLS[command][0] == "not run"
    args = _parser().parse_args(_argv(command)[1:])
    assert planned_bytes(args.size, args.samples) == 20_401_094_656


def test_kfac_plan_table_is_the_commands_output(cli_in_process):
    """docs/kfac.md's KAISA table is what ``lightning-hpc plan-kfac --model resnet50 --world-size 8`` prints."""
    text = (REPO / "docs" / "kfac.md").read_text()
    assert "(`--model resnet50 --world-size 8`, float32, eigen; MiB, max over ranks)" in text
    (table,) = [b.text for b in _blocks() if b.file == "docs/kfac.md" and b.text.startswith(" fraction  workers")]
    out = cli_in_process("plan-kfac", "--model", "resnet50", "--world-size", "8").stdout
    assert table in out, f"regenerate the table in docs/kfac.md from:\n{out}"
