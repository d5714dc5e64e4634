#!/usr/bin/env python3
"""The wheel as users get it: `pip wheel --no-build-isolation` (the venv's scikit-build-core and
nanobind) builds it from the repository, `pip install` puts it into a fresh venv (with the
system's site packages, for NumPy), and that venv's interpreter imports it from a directory
outside the repository, without PYTHONPATH, and prints its version and features.

The build directory is --work/build (scikit-build-core's build-dir), kept between runs so that a
rerun only rebuilds what changed. Exit 0 when every step works, 1 otherwise.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time


def run(command, **kwargs):
    print("+", " ".join(map(str, command)), flush=True)
    started = time.monotonic()
    result = subprocess.run(command, **kwargs)
    print(f"  ({time.monotonic() - started:.0f} s, exit {result.returncode})", flush=True)
    if result.returncode != 0:
        sys.exit(f"wheel_test: failed: {' '.join(map(str, command))}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, type=pathlib.Path, help="the repository")
    parser.add_argument("--work", required=True, type=pathlib.Path, help="scratch directory")
    args = parser.parse_args()
    work = args.work.resolve()
    dist = work / "dist"
    venv = work / "venv"
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree(venv, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--disable-pip-version-check", "-w", dist, "--config-settings", f"build-dir={work / 'build'}",
         args.source], env=env)
    wheels = list(dist.glob("pulseloco-*.whl"))
    if len(wheels) != 1:
        sys.exit(f"wheel_test: expected one wheel in {dist}, found {wheels}")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv], env=env)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", wheels[0]], env=env)
    check = ("import pathlib, sys, pulseloco\n"
             f"assert pathlib.Path(pulseloco.__file__).is_relative_to({str(venv)!r}), "
             "pulseloco.__file__\n"
             "features = pulseloco.features()\n"
             "assert features['version'] == pulseloco.__version__ and not features['libtorch']\n"
             "print(pulseloco.__version__, features)\n")
    with tempfile.TemporaryDirectory() as outside:
        result = run([python, "-c", check], cwd=outside, env=env, capture_output=True,
                     text=True)
    print(result.stdout, end="")
    print(f"wheel_test: {wheels[0].name} installs and imports: {result.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
