"""One readable log: under `python -m pulseloco.launch`, 4 ranks at the default log level write
one window line per window into the combined output (rank 0's), one line per checkpoint, and no
info line from another rank; PULSELOCO_LOG_ALL_RANKS=1 brings every rank's window line back. A
Synchronizer without launcher variables or a world size warns once that it runs alone."""

import os
import pathlib
import subprocess
import sys
import textwrap

from group_helpers import clean_environment

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
    sync.save_checkpoint(CHECKPOINTS)
    sync.close()
"""


def launch_one_window(tmp_path, **extra_env):
    """The combined output's lines of the launched group (4 ranks, one window, one checkpoint)."""
    script = tmp_path / "one_window.py"
    script.write_text(f"CHECKPOINTS = {str(tmp_path / 'checkpoints')!r}\n"
                      + textwrap.dedent(SCRIPT))
    env = dict(os.environ, **extra_env)
    env.pop("PULSELOCO_LOG_LEVEL", None)
    result = subprocess.run([sys.executable, str(LAUNCH), "--nproc-per-node", "4", str(script)],
                            env=env, capture_output=True, text=True, timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    return (result.stdout + result.stderr).splitlines()


def window_lines(lines):
    return [line for line in lines if "window 0 pulse:" in line]


def test_four_ranks_write_one_window_line_at_the_default_level(tmp_path):
    combined = launch_one_window(tmp_path)
    lines = window_lines(combined)
    assert len(lines) == 1, lines
    assert lines[0].startswith("[rank 0] "), lines
    committed = [line for line in combined
                 if "checkpoint of window" in line and " committed in " in line]
    assert len(committed) == 1 and committed[0].startswith("[rank 0] "), combined
    others_info = [line for line in combined
                   if not line.startswith("[rank 0] ") and "[info]" in line]
    assert others_info == [], others_info


def test_every_rank_writes_its_window_line_when_asked(tmp_path):
    # Any of the boolean spellings of the other PULSELOCO_* variables.
    lines = window_lines(launch_one_window(tmp_path, PULSELOCO_LOG_ALL_RANKS="true"))
    assert sorted(line[:len("[rank 0]")] for line in lines) == [
        f"[rank {r}]" for r in range(4)], lines


ALONE = """
    import numpy as np
    import pulseloco

    for _ in range(2):
        with pulseloco.Synchronizer([np.ones(16, np.float32)], inner_steps=1, **OPTIONS) as sync:
            assert sync.world_size == 1
            sync.after_optimizer_step()
"""

def run_alone(tmp_path, options, **extra_env):
    """stderr of a script that makes two Synchronizers with `options` and no launcher (nothing
    that would tell it where other ranks are), at the default log level."""
    script = tmp_path / "alone.py"
    script.write_text(f"OPTIONS = {options!r}\n" + textwrap.dedent(ALONE))
    env = dict(clean_environment(), **extra_env)
    env.pop("PULSELOCO_LOG_LEVEL")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=BOUND_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stderr


def test_a_synchronizer_without_launcher_variables_warns_once_that_it_runs_alone(tmp_path):
    stderr = run_alone(tmp_path, {})
    warnings = [line for line in stderr.splitlines() if "trains as a group of one" in line]
    assert len(warnings) == 1, stderr
    assert "python -m pulseloco.launch --nproc-per-node N" in warnings[0], warnings
    assert "world_size" in warnings[0], warnings


def test_an_explicit_world_size_of_one_runs_alone_silently(tmp_path):
    stderr = run_alone(tmp_path, {"group": {"world_size": 1}})
    assert "group of one" not in stderr, stderr


def test_a_bad_log_all_ranks_value_is_named_in_a_warning(tmp_path):
    # A logging variable never stops a run; a value that is no boolean is not taken silently.
    stderr = run_alone(tmp_path, {"group": {"world_size": 1}}, PULSELOCO_LOG_ALL_RANKS="2")
    warnings = [line for line in stderr.splitlines()
                if "PULSELOCO_LOG_ALL_RANKS='2' is not a boolean (1/0, true/false, yes/no, "
                "on/off); using 0" in line]
    assert len(warnings) == 1, stderr
