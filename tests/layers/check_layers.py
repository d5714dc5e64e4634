#!/usr/bin/env python3
"""The layer rules of docs/design.md, enforced on every #include of the library's sources.

Each library folder may include the pulseloco components and the third-party libraries its rule
names, and nothing else. A violation is printed as `file:line: <what> may not use <what>` and
the exit status is 1. The rules live here; docs/design.md shows the same table
(`check_layers.py --table` prints it, and the suite checks that the two agree).

  check_layers.py --root REPO             check the tree
  check_layers.py --root REPO --table     print the rules as docs/design.md's table
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Third-party libraries by the first part of their include path. Headers of the C and C++
# standard libraries and of the operating system (sys/, netinet/, ...) are not listed: any
# layer may use them.
THIRD_PARTY = {
    "fmt": "fmt", "spdlog": "spdlog", "xxhash.h": "xxhash", "zstd.h": "zstd",
    "zstd_errors.h": "zstd", "nlohmann": "nlohmann-json", "boost": "Boost.Asio",
    "openssl": "OpenSSL", "mpi.h": "MPI", "nccl.h": "NCCL", "cuda.h": "CUDA",
    "cuda_runtime.h": "CUDA", "cuda_runtime_api.h": "CUDA", "cuda_bf16.h": "CUDA",
    "cub": "CUDA", "thrust": "CUDA", "torch": "libtorch", "ATen": "libtorch", "c10": "libtorch",
    "CLI": "CLI11", "nanobind": "nanobind", "curl": "libcurl", "expat.h": "expat",
}


@dataclass(frozen=True)
class Rule:
    target: str
    folder: str  # relative to the repository root
    uses: tuple[str, ...]  # pulseloco components (by include name) and third-party libraries
    never: str  # for the table: what it must never use, in words


# The most specific folder wins: transport/mpi has a rule of its own beside transport.
RULES = (
    Rule("pulseloco_base", "src/base", ("fmt", "spdlog", "xxhash"), "anything of pulseloco"),
    Rule("pulseloco_kernels", "kernels", ("base",), "codec, transport, ranks, files"),
    Rule("pulseloco_kernels_cuda", "kernels/cuda", ("base", "kernels", "CUDA"),
         "codec, transport, ranks, files"),
    Rule("pulseloco_codec", "src/codec", ("base", "zstd", "xxhash"), "kernels, transport"),
    Rule("pulseloco_io", "src/io", ("base", "nlohmann-json", "libcurl", "expat", "OpenSSL"),
         "everything else"),
    Rule("pulseloco_transport", "transport", ("base", "Boost.Asio", "OpenSSL"),
         "tensors, windows, codec, everything above it"),
    Rule("pulseloco_transport_mpi", "transport/mpi", ("base", "transport", "MPI"),
         "everything above transport"),
    Rule("pulseloco_transport_nccl", "transport/nccl", ("base", "transport", "NCCL", "CUDA"),
         "everything above transport"),
    Rule("pulseloco_patch", "src/patch",
         ("base", "kernels", "codec", "io", "transport", "nlohmann-json"),
         "group, collectives, engine, everything above it"),
    Rule("pulseloco_group", "src/group",
         ("base", "transport", "Boost.Asio", "OpenSSL", "nlohmann-json"),
         "collectives, engine, elastic"),
    Rule("pulseloco_collectives", "collectives", ("base", "transport"), "codec, kernels, engine"),
    Rule("pulseloco_engine", "src/engine",
         ("base", "kernels", "codec", "io", "patch", "transport", "collectives", "nlohmann-json"),
         "group, elastic, libtorch"),
    Rule("pulseloco_engine_cuda", "src/engine/cuda", ("base", "kernels", "engine", "CUDA"),
         "group, elastic, libtorch"),
    Rule("pulseloco_elastic", "src/elastic",
         ("base", "transport", "group", "collectives", "engine", "Boost.Asio", "OpenSSL",
          "nlohmann-json"), "libtorch"),
    Rule("pulseloco_torch", "src/adapters/torch",
         ("base", "transport", "engine", "elastic", "libtorch"),
         "-"),
    Rule("_pulseloco (Python)", "src/adapters/python",
         ("base", "transport", "group", "engine", "elastic", "nanobind", "MPI", "nlohmann-json"),
         "libtorch"),
    Rule("pulseloco (tool)", "src/cli",
         ("base", "kernels", "codec", "io", "patch", "transport", "group", "collectives", "engine",
          "elastic", "CLI11", "nlohmann-json"), "libtorch"),
    Rule("public headers", "src/pulseloco",
         ("base", "kernels", "codec", "io", "transport", "group", "collectives", "engine",
          "elastic", "adapters"), "-"),
)

# fmt is part of base's public interface (logging and error formatting): every layer may use it.
EVERYWHERE = ("fmt",)

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
SOURCE_SUFFIXES = {".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu", ".in"}


def rule_for(path: Path, root: Path) -> Rule | None:
    relative = path.relative_to(root).as_posix()
    best = None
    for rule in RULES:
        if relative.startswith(rule.folder + "/"):
            if best is None or len(rule.folder) > len(best.folder):
                best = rule
    return best


def own_component(rule: Rule) -> str:
    """The include name of the rule's own component (<pulseloco/<name>/...>)."""
    folder = rule.folder.removeprefix("src/")
    return folder.split("/")[0]


def what_is_included(header: str) -> str | None:
    """The pulseloco component or third-party library an include names; None for the rest."""
    if header == "pulseloco/build_config.h":
        return "base"  # what the build contains: part of base, usable everywhere
    if header.startswith("pulseloco/"):
        parts = header.split("/")
        return parts[1] if len(parts) > 2 else "public headers"
    return THIRD_PARTY.get(header.split("/")[0])


def check(root: Path) -> list[str]:
    problems = []
    for rule in RULES:
        folder = root / rule.folder
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or rule_for(path, root) is not rule:
                continue
            allowed = set(rule.uses) | set(EVERYWHERE) | {own_component(rule)}
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                used = what_is_included(match.group(1))
                if used is None or used in allowed:
                    continue
                if used == "public headers" and rule.folder == "src/pulseloco":
                    continue
                problems.append(
                    f"{path.relative_to(root)}:{number}: {rule.target} ({rule.folder}) may not "
                    f"use {used} (#include <{match.group(1)}>); its rule allows "
                    f"{', '.join(rule.uses)} (docs/design.md, 'Layers and dependency rules')")
    return problems


def table() -> str:
    lines = ["| target | folder | may use | never uses |", "|---|---|---|---|"]
    for rule in RULES:
        lines.append(f"| `{rule.target}` | `{rule.folder}` | {', '.join(rule.uses)} | "
                     f"{rule.never} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the repository root")
    parser.add_argument("--table", action="store_true", help="print the rules as a table")
    parser.add_argument("--design", type=Path,
                        help="also check that this file (docs/design.md) shows the table")
    args = parser.parse_args()
    if args.table:
        sys.stdout.write(table())
        return 0
    root = args.root.resolve()
    problems = check(root)
    if args.design and table() not in args.design.read_text():
        problems.append(f"{args.design}: the layer table differs from the rules in "
                        f"{Path(__file__).name}; paste the output of --table")
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} violation(s)")
        return 1
    print(f"check_layers: every include of {len(RULES)} folders follows its rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
