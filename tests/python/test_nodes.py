"""Node-aware exchanges from Python: two launchers with --nnodes 2, two ranks each, form one
group of four whose pulse windows run node-aware over 2 nodes, with every rank on the same
digests as the same run with node_aware off."""

import os
import pathlib
import subprocess
import sys
import textwrap

from group_helpers import free_port

HERE = pathlib.Path(__file__).resolve().parent
LAUNCH = HERE.parents[1] / "python" / "pulseloco" / "launch.py"
BOUND_SECONDS = 240  # four interpreters forming a group on two busy cores

SCRIPT = """
    import sys
    import numpy as np
    import pulseloco

    node_aware = sys.argv[1] == "on"
    weights = np.linspace(-0.05, 0.05, 20000, dtype=np.float32)
    sync = pulseloco.Synchronizer({"w": weights}, inner_steps=1, timeout=60,
                                  node_aware=node_aware, chunk_elements=4096)
    rng = np.random.default_rng(sync.rank)
    for step in range(3):
        weights += rng.normal(0, 1e-3, weights.size).astype(np.float32)
        report = sync.after_optimizer_step()
        print(f"digest {report.window} {report.digest}", flush=True)
    sync.close()
"""


def run_two_nodes(tmp_path, node_aware):
    script = tmp_path / "two_nodes.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PULSELOCO_SECRET="two-nodes-secret",
               PULSELOCO_RUN_ID=f"two-nodes-{node_aware}", PULSELOCO_LOG_LEVEL="info")
    env.pop("PULSELOCO_NODE", None)
    port = str(free_port())
    launchers = [subprocess.Popen([sys.executable, str(LAUNCH), "--nnodes", "2", "--node-rank",
                                   str(node), "--nproc-per-node", "2", "--master-port", port,
                                   str(script), node_aware],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node in (0, 1)]
    outputs = []
    for launcher in launchers:
        out, err = launcher.communicate(timeout=BOUND_SECONDS)
        outputs.append(out + err)
    if any(launcher.returncode != 0 for launcher in launchers):
        return None, "\n".join(outputs)
    digests = {}
    for line in "".join(outputs).splitlines():
        prefix, _, rest = line.partition("] digest ")
        if rest:
            window, digest = rest.split()
            digests.setdefault(int(window), {})[prefix.removeprefix("[rank ")] = digest
    return digests, outputs[0]


def run_until_the_port_holds(tmp_path, node_aware):
    """run_two_nodes, again when the free port found for the rendezvous was taken before rank 0
    bound it (another test running beside this one may take it meanwhile)."""
    for attempt in range(3):
        digests, log = run_two_nodes(tmp_path, node_aware)
        if digests is not None:
            return digests, log
        if "Address already in use" not in log or attempt == 2:
            raise AssertionError(log)
    raise AssertionError("unreachable")


def test_two_launchers_form_a_node_aware_group_with_the_flat_groups_digests(tmp_path):
    aware, log = run_until_the_port_holds(tmp_path, "on")
    assert "exchange node-aware over 2 nodes" in log, log
    flat, flat_log = run_until_the_port_holds(tmp_path, "off")
    assert "exchange flat" in flat_log, flat_log
    assert sorted(aware) == [0, 1, 2]
    for window, by_rank in aware.items():
        assert sorted(by_rank) == ["0", "1", "2", "3"], by_rank
        assert len(set(by_rank.values())) == 1, by_rank
        assert set(flat[window].values()) == set(by_rank.values()), (window, flat[window])
