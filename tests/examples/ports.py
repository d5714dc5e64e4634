"""Rendezvous ports for the example tests' process groups, chosen as the launcher chooses them
(below the ephemeral range, so that no process's own connections or listeners take the port
before rank 0 binds it). python/pulseloco/launch.py is loaded by path: these tests run without
the Python package being built."""
import importlib.util
import pathlib
import sys

_LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "python" / "pulseloco" / "launch.py"


def free_port() -> int:
    spec = importlib.util.spec_from_file_location("pulseloco_launch_for_tests", _LAUNCH)
    launch = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = launch  # its dataclasses look their module up there
    spec.loader.exec_module(launch)
    return launch._ports_below_ephemeral("127.0.0.1", 1)[0]
