"""docs/cluster.md shows the launch files of examples/cluster (which the tier runs): the sbatch script
verbatim, and every option of each command block present in its example file."""

import re

from tests.cluster.launch import EXAMPLES, REPO

DOC = REPO / "docs" / "cluster.md"


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)


def _options(text: str) -> set[str]:
    """``--flag`` names and ``key=`` override names of the command lines (comments dropped)."""
    lines = [line.split("#", 1)[0] for line in text.splitlines() if not line.lstrip().startswith("#")]
    words = " ".join(lines).replace("\\", " ").split()
    out = set()
    for w in words:
        if w.startswith("--"):
            out.add(w.split("=", 1)[0])
        elif re.match(r"^[a-z_/.]+=", w):
            out.add(w.split("=", 1)[0] + "=")
    return out


def test_the_sbatch_script_is_shown_verbatim():
    script = (EXAMPLES / "train.sbatch").read_text()
    body = "\n".join(line for line in script.splitlines()[1:] if not line.startswith("# ")).strip()
    shown = [b for b in _blocks() if "#SBATCH" in b]
    assert shown, "docs/cluster.md shows no sbatch script"
    shown_body = "\n".join(line for line in shown[0].splitlines()[1:]).strip()
    assert shown_body == body


def test_every_shown_option_is_in_the_example_it_names():
    files = {
        "--rdzv-backend=c10d": "torchrun_c10d.sh",
        "--node-rank": "torchrun_static.sh",
        "srun --nodes": "srun.sh",
        "submitit_slurm": "submitit_sweep.sh",
        "horovodrun --gloo": "horovodrun.sh",
    }
    checked = set()
    for block in _blocks():
        for marker, name in files.items():
            if marker in block:
                command = block.split("# or:", 1)[0]
                missing = _options(command) - _options((EXAMPLES / name).read_text())
                assert not missing, f"docs/cluster.md shows {sorted(missing)} that {name} does not use"
                checked.add(name)
    assert checked == set(files.values()), checked
