"""One readable log: under `python -m pulseloco.launch`, 4 ranks at the default log level write
one window line per window into the combined output (rank 0's); PULSELOCO_LOG_ALL_RANKS=1 brings
every rank's back."""

import os
import pathlib
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).resolve().parent
LAUNCH = HERE.parents[1] / "python" / "pulseloco" / "launch.py"
BOUND_SECONDS = 240  # four interpreters forming a group on two busy cores

SCRIPT = """
    import numpy as np
    import pulseloco

    rank_weights = np.full(4096, 0.01, dtype=np.float32)
    sync = pulseloco.Synchronizer({"w": rank_weights}, inner_steps=1, timeout=60)
    rank_weights += 0.001 * (sync.rank + 1)
    report = sync.after_optimizer_step()
    assert report is not None and report.window == 0
    sync.close()
"""


def launch_one_window(tmp_path, **extra_env):
    script = tmp_path / "one_window.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, **extra_env)
    env.pop("PULSELOCO_LOG_LEVEL", None)
    result = subprocess.run([sys.executable, str(LAUNCH), "--nproc-per-node", "4", str(script)],
                            env=env, capture_output=True, text=True, timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    combined = (result.stdout + result.stderr).splitlines()
    return [line for line in combined if "window 0 pulse:" in line]


def test_four_ranks_write_one_window_line_at_the_default_level(tmp_path):
    lines = launch_one_window(tmp_path)
    assert len(lines) == 1, lines
    assert lines[0].startswith("[rank 0] "), lines


def test_every_rank_writes_its_window_line_when_asked(tmp_path):
    lines = launch_one_window(tmp_path, PULSELOCO_LOG_ALL_RANKS="1")
    assert sorted(line[:len("[rank 0]")] for line in lines) == [
        f"[rank {r}]" for r in range(4)], lines
