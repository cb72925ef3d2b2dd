"""Make Lightning's per-rank re-launch correct under Hydra, including ``--multirun``.

Lightning starts ranks 1..N-1 of a multi-process CPU/GPU run by re-executing the command line.  Its Hydra
variant re-uses ``sys.argv`` (so under ``--multirun`` every child would run the whole sweep again) and the
*run* directory pattern (so children of a sweep job write next to, not into, the job's directory).  We rebuild
the child command from the current job alone: this job's overrides, its output directory, no config
output (rank 0 already wrote it), so folders do not multiply and ranks never fight over the run dir.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning_hpc._compat import replace_hydra_subprocess_command

__all__ = ["child_command", "install"]

_ENTRY: list[str] = [sys.executable, "-m", "lightning_hpc", "train"]


def child_command(local_rank: int) -> tuple[Sequence[str], str]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    cfg = HydraConfig.get()
    overrides = list(cfg.overrides.task)
    extra = [a for a in _EXTRA_ARGS]
    command = [
        *_ENTRY,
        *extra,
        *overrides,
        f"hydra.run.dir={cfg.runtime.output_dir}",
        f"hydra.job.name={cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/hydra_logging=none",
        "hydra/job_logging=none",
    ]
    return command, get_original_cwd()


_EXTRA_ARGS: list[str] = []


def install(extra_args: Sequence[str] = ()) -> None:
    """Route Lightning's Hydra child command through :func:`child_command`.

    ``extra_args`` are arguments our CLI consumed before Hydra saw them (``recipe=...``, the search path) and
    that the children need again.
    """
    _EXTRA_ARGS[:] = list(extra_args)
    replace_hydra_subprocess_command(child_command)
