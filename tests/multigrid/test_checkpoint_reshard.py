"""Multigrid checkpoints are full-state, in the layout one process training the serial model writes, and resume
on another number of processes or ``layer_parallel_size`` (CPU gloo, through ``Trainer.fit``).

One 2-process run trains the 16-step ODE-ResNet with ``layer_parallel_size=2`` for 2 epochs of 2 steps (float64,
exact multigrid solve), writing a checkpoint after each epoch.  From its epoch-0 checkpoint the second epoch is
run again (a) on 2 processes with ``layer_parallel_size=2``, (b) on 1 process (``layer_parallel_size=1``), (c) on
2 processes with ``layer_parallel_size=1`` (data parallel), (d) in a plain one-process Trainer without multigrid,
and for SGD (e) from the same checkpoint rewritten in the per-layer-rank format of earlier versions; (f) a
plain one-process Trainer's epoch-0 checkpoint resumes on 2 processes with ``layer_parallel_size=2``.  The
optimizer state right after the restore equals, parameter by parameter, the state the uninterrupted run had
at the end of epoch 0 (bit for bit: momentum buffers, AdamW's exp_avg / exp_avg_sq / step), and the parameters
after the second epoch equal the uninterrupted run's: bit for bit with the same layout, to float64 rounding
(the 1-rank and 2-rank solves round differently) otherwise.
"""

import pytest
import torch
from mg_lightning_workers import NUM_STEPS, fit_resume, make_optimizer, save_then_resume, state_by_name

from lightning_hpc import ImageClassifier
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models import ode_resnet

TOL = dict(rtol=1e-9, atol=1e-12)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _merge(parts: list[dict]) -> dict:
    """Union of the ranks' dicts by parameter name; a replicated entry must be identical on every rank."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            assert key not in out or _same(out[key], value), key
            out[key] = value
    return out


def _assert_state_exact(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, entry in want.items():
        assert entry.keys() == got[name].keys(), name
        for key, value in entry.items():
            assert _same(got[name][key], value), (name, key)


def _assert_params(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if exact:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, **TOL, msg=name)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_resume_on_other_layouts_equals_uninterrupted(tmp_path, kind):
    plain_run = fit_resume(0, 1, None, kind, 1, str(tmp_path / "plain"))  # epoch 0 in a plain Trainer
    plain_checkpoint = str(tmp_path / "plain" / "epoch=0.ckpt")
    runs = run_in_processes(
        save_then_resume, 2, kind, str(tmp_path), plain_checkpoint, timeout_s=900, collective_timeout_s=300
    )
    plain = ImageClassifier(ode_resnet(num_steps=NUM_STEPS, width=4)).double()
    names = [n for n, _ in plain.named_parameters()]
    trunk = [n for n in names if n.startswith("model.steps.")]
    for rank, run in enumerate(runs):  # each layer rank held its half of the trunk and only its state
        held = [n for n in run["full"]["params"] if n.startswith("model.steps.")]
        assert len(held) == len(trunk) // 2 and all(int(n.split(".")[2]) // (NUM_STEPS // 2) == rank for n in held)
        assert run["full"]["epoch0"].keys() == run["full"]["params"].keys()
    final = _merge([r["full"]["params"] for r in runs])
    epoch0 = _merge([r["full"]["epoch0"] for r in runs])
    assert list(final) == names or sorted(final) == sorted(names)
    assert set(epoch0) == set(names)  # every parameter has optimizer state

    # the checkpoint's optimizer state is the serial optimizer's: it loads into the plain model's optimizer
    ckpt = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    serial_optimizer = make_optimizer(kind)(plain.parameters())
    serial_optimizer.load_state_dict(ckpt["optimizer_states"][0])
    _assert_state_exact(state_by_name(serial_optimizer, plain), epoch0)
    assert [len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"]] == [
        len(g["params"]) for g in serial_optimizer.state_dict()["param_groups"]
    ]
    assert not torch.equal(
        ckpt["state_dict"]["model.steps.15.branch.0.weight"], final["model.steps.15.branch.0.weight"]
    )

    # (a) 2 processes, layer_parallel_size=2: the same computation, bit for bit
    _assert_state_exact(_merge([r["lp2"]["start"] for r in runs]), epoch0)
    _assert_params(_merge([r["lp2"]["params"] for r in runs]), final, exact=True)
    # (c) 2 processes, layer_parallel_size=1: each rank holds the whole model and all of the state
    for run in runs:
        _assert_state_exact(run["lp1"]["start"], epoch0)
        _assert_params(run["lp1"]["params"], final, exact=False)
    # (b) 1 process, layer_parallel_size=1; (d) a plain one-process Trainer (the exact solve is the serial network)
    first = str(tmp_path / "epoch=0.ckpt")
    for layer_parallel_size in (1, None):
        one = fit_resume(0, 1, layer_parallel_size, kind, 2, None, first)
        assert one["global_step"] == runs[0]["full"]["global_step"] == 4
        _assert_state_exact(one["start"], epoch0)
        _assert_params(one["params"], final, exact=False)
    # (f) a plain one-process Trainer's checkpoint resumes with layer_parallel_size=2 (its epoch 0 is the
    # layer-parallel epoch 0 to rounding: exact solve)
    _assert_state_exact(_merge([r["from_plain"]["start"] for r in runs]), plain_run["epoch0"])
    _assert_params(_merge([r["from_plain"]["params"] for r in runs]), final, exact=False)
    # (e) the per-layer-rank format of earlier versions still resumes with its layer_parallel_size ...
    if kind == "sgd":
        _assert_state_exact(_merge([r["legacy"]["start"] for r in runs]), epoch0)
        _assert_params(_merge([r["legacy"]["params"] for r in runs]), final, exact=True)
        # ... and is refused with another one, naming what to do
        with pytest.raises(
            ValueError, match="earlier versions, saved with layer_parallel_size=2.*Resume with layer_parallel_size=2"
        ):
            fit_resume(0, 1, 1, kind, 2, None, str(tmp_path / "legacy.ckpt"))


def test_serial_layout_places_every_ranks_steps_between_the_replicated_parameters():
    from lightning_hpc.multigrid.checkpoint import serial_layout

    def rank(steps):  # group 0: weights (opening, the rank's steps, closing); group 1: the steps' biases only
        return [
            [("open.w", False), *[(f"steps.{s}.w", True) for s in steps], ("close.w", False)],
            [(f"steps.{s}.b", True) for s in steps],
        ]

    layout = serial_layout([rank([0, 1]), rank([2, 3])])
    assert layout == [
        ["open.w", "steps.0.w", "steps.1.w", "steps.2.w", "steps.3.w", "close.w"],
        ["steps.0.b", "steps.1.b", "steps.2.b", "steps.3.b"],
    ]
    assert serial_layout([rank([0, 1, 2, 3])]) == layout  # one rank: its own order
    with pytest.raises(ValueError, match="param group 0 holds different replicated"):
        serial_layout([rank([0, 1]), [[("close.w", False), ("open.w", False)], []]])
    with pytest.raises(ValueError, match="different numbers of param groups"):
        serial_layout([rank([0, 1]), rank([2, 3])[:1]])


@pytest.mark.slow
def test_data_by_layer_mesh_checkpoint_resumes_on_one_process(tmp_path):
    """4 processes as 2 (data) x 2 (layer): only the chain of rank 0 gathers; the checkpoint resumes on 1 process
    with the optimizer state exact and the parameters of the uninterrupted run."""
    runs = run_in_processes(fit_resume, 4, 2, "adamw", 2, str(tmp_path), timeout_s=900, collective_timeout_s=300)
    final = _merge([r["params"] for r in runs])
    epoch0 = _merge([r["epoch0"] for r in runs])
    one = fit_resume(0, 1, 1, "adamw", 2, None, str(tmp_path / "epoch=0.ckpt"))
    _assert_state_exact(one["start"], epoch0)
    _assert_params(one["params"], final, exact=False)
