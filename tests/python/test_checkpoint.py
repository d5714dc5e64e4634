"""A checkpoint saved from Python (engine state and the AdamW optimizer's) resumes bit for bit:
a run interrupted after window 2 and resumed from its checkpoint the documented way (the data
continues at loaded.next_step) ends with the digest and weights of a run that never stopped, in
every mode and overlap."""

import pytest

from group_helpers import run_group

WINDOWS = 4
SAVE_AFTER = 2  # windows committed when the checkpoint is taken


@pytest.mark.parametrize("mode,overlap", [("pulse", "blocking"), ("pulse", "delayed"),
                                          ("pulse", "eager"), ("diloco", "blocking"),
                                          ("ddp", "blocking")])
def test_resumed_run_matches_the_uninterrupted_run(tmp_path, mode, overlap):
    root = tmp_path / "checkpoints"
    inner_steps = 3
    common = ["--mode", mode, "--overlap", overlap, "--inner-steps", str(inner_steps)]
    full = run_group(2, [*common, "--windows", str(WINDOWS), "--save", str(root),
                         "--save-after", str(SAVE_AFTER)], timeout=180)
    for process in full:
        assert process.popen.returncode == 0, process.log()
        assert process.event("saved")["path"].startswith(str(root))
    resumed = run_group(2, [*common, "--windows", str(WINDOWS), "--resume", str(root)],
                        timeout=180)
    # Overlapped windows: window SAVE_AFTER was in flight when the checkpoint was taken; its
    # exchange is sent again on resume and the data continues with the window after it.
    next_window = SAVE_AFTER if overlap == "blocking" else SAVE_AFTER + 1
    for before, after in zip(full, resumed):
        assert after.popen.returncode == 0, after.log()
        loaded = after.event("loaded")
        assert loaded["window"] == SAVE_AFTER
        assert loaded["next_window"] == next_window
        assert loaded["next_step"] == next_window * inner_steps
        assert [e["window"] for e in after.events if e["event"] == "window"] == list(
            range(next_window, WINDOWS))
        assert after.event("done")["digest"] == before.event("done")["digest"]
        assert after.event("done")["weights"] == before.event("done")["weights"]
