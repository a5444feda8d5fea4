"""nxd-trainer[train]: the `nxd-train` command trains 2 steps of a tiny Llama on one CPU process,
checkpoints and exports a Hugging Face folder (tiny settings: seconds, not minutes)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = "--nproc-per-node 1 --tp 1 --steps 2 --corpus-mb 0.2 --vocab-size 300 --seq-len 32"
TINY += " --batch-size 2 --no-progress --sample-tokens 0"


def main() -> None:
    command = Path(sys.executable).with_name("nxd-train")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([str(command), *TINY.split()], cwd=folder, check=True)
        run = Path(folder, "runs", "tiny")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["step"] == 2, summary
        assert not summary["interrupted"], summary
        assert (run / "checkpoints" / "step_00000002").is_dir(), sorted(run.iterdir())
        assert (run / "hf" / "model.safetensors").is_file(), sorted(run.iterdir())
    print("nxd-train smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
