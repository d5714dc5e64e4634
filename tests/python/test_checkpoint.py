"""A checkpoint saved from Python (engine state and the AdamW optimizer's) resumes bit for bit:
a run interrupted after window 2 and resumed from its checkpoint ends with the digest and
weights of a run that never stopped."""

import pytest

from group_helpers import run_group

WINDOWS = 4


@pytest.mark.parametrize("mode", ["pulse", "ddp"])
def test_resumed_run_matches_the_uninterrupted_run(tmp_path, mode):
    root = tmp_path / "checkpoints"
    common = ["--mode", mode, "--inner-steps", "3"]
    full = run_group(2, [*common, "--windows", str(WINDOWS), "--save", str(root),
                         "--save-after", "2"], timeout=180)
    for process in full:
        assert process.popen.returncode == 0, process.log()
        assert process.event("saved")["path"].startswith(str(root))
    resumed = run_group(2, [*common, "--windows", str(WINDOWS), "--resume", str(root)],
                        timeout=180)
    for before, after in zip(full, resumed):
        assert after.popen.returncode == 0, after.log()
        assert after.event("loaded")["window"] == 2
        assert [e["window"] for e in after.events if e["event"] == "window"] == [2, 3]
        assert after.event("done")["digest"] == before.event("done")["digest"]
        assert after.event("done")["weights"] == before.event("done")["weights"]
