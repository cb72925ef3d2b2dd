"""Several Horovod cases in one ``horovodrun`` launch: ``python run_cases.py OUT SPEC``.

SPEC is a JSON list of ``[folder, case, args]``; the cases (:data:`CASES`) run in that order, each writing
``OUT/folder/rank{r}.pt`` (and whatever else it writes) on every rank.  Starting ``horovodrun`` and importing
Lightning on every rank takes seconds; the tests' cases of one world size share one launch (hvd_launch.TWO_RANKS,
hvd_launch.FOUR_RANKS).  A case that fails ends the launch, and the tests that read it fail with its output.

Order matters where a case checks the torch threads the strategy picks (``threads``, and ``train_digits``, which
records them too): Lightning sets them at most once per process, so such a case must be the first fit of its
launch.  Each case records ``OMP_NUM_THREADS`` as it found it (``omp_at_start_rank{r}.json``) so the tests can
check that.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _threads(out: Path, args: list[str]) -> None:
    import threads_case

    threads_case.main(out)


def _launch_checks(out: Path, args: list[str]) -> None:
    """``devices`` / ``num_nodes`` that do not describe the launch are refused with the launch to use."""
    import lightning.pytorch as pl

    import lightning_hpc  # noqa: F401  registers strategy="horovod"
    from lightning_hpc.horovod.communicator import init_horovod

    hvd = init_horovod()
    errors = {}
    for name, kwargs in (("devices", {"devices": hvd.local_size() + 1}), ("num_nodes", {"num_nodes": 2})):
        try:
            pl.Trainer(strategy="horovod", accelerator="cpu", logger=False, **kwargs)
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    torch.save({"errors": errors, "local_size": hvd.local_size()}, out / f"rank{hvd.rank()}.pt")


def _train_digits(out: Path, args: list[str]) -> None:
    import train_digits

    train_digits.main([str(out), *args])


def _kfac_case(out: Path, args: list[str]) -> None:
    import kfac_case

    kfac_case.main(out)


def _collectives(out: Path, args: list[str]) -> None:
    import collectives

    collectives.main(out)


def _layered_case(out: Path, args: list[str]) -> None:
    import layered_case

    layered_case.main(out)


def _layered_trainer(out: Path, args: list[str]) -> None:
    import layered_trainer

    layered_trainer.main(out)


def _cli_train(out: Path, args: list[str]) -> None:
    """``lightning-hpc train ARGS hydra.run.dir=OUT`` in this rank (the command's entry point, in process)."""
    from lightning_hpc.cli.main import main

    code = main(["train", *args, f"hydra.run.dir={out}"])
    if code != 0:
        raise SystemExit(code)


CASES: dict[str, Callable[[Path, list[str]], None]] = {
    "threads": _threads,
    "launch_checks": _launch_checks,
    "train_digits": _train_digits,
    "kfac_case": _kfac_case,
    "collectives": _collectives,
    "layered_case": _layered_case,
    "layered_trainer": _layered_trainer,
    "cli_train": _cli_train,
}


def main(out: Path, spec: list[tuple[str, str, list[str]]]) -> None:
    for result_dir, name, args in spec:
        case_out = out / result_dir
        case_out.mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("HOROVOD_RANK", "0")
        (case_out / f"omp_at_start_rank{rank}.json").write_text(json.dumps(os.environ.get("OMP_NUM_THREADS")))
        CASES[name](case_out, args)
        print(f"CASE {result_dir} DONE on rank {rank}", flush=True)


if __name__ == "__main__":
    # the stock-DDP reference runs leave gloo's group alive; without this a finished run may abort at exit
    from lightning_hpc.distributed.exit import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
