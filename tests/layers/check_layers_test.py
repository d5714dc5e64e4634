#!/usr/bin/env python3
"""check_layers.py itself: it must fail on a forbidden include and pass on allowed ones."""
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

CHECKER = Path(__file__).with_name("check_layers.py")


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECKER, "--root", root], capture_output=True,
                          text=True, check=False)


class CheckLayers(unittest.TestCase):
    def tree(self, files: dict[str, str]) -> Path:
        root = Path(self.enterContext(tempfile.TemporaryDirectory()))
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return root

    def test_allowed_includes_pass(self):
        root = self.tree({
            "src/engine/window.cpp": "#include <pulseloco/collectives/collectives.h>\n"
                                     "#include <pulseloco/engine/engine.h>\n#include <vector>\n",
            "transport/mpi/mpi_transport.cpp": "#include <mpi.h>\n"
                                               "#include <pulseloco/transport/transport.h>\n",
            "collectives/x.cpp": "#include <fmt/format.h>\n#include <pulseloco/build_config.h>\n",
        })
        result = run(root)
        self.assertEqual(result.returncode, 0, result.stdout)

    def test_a_layer_above_is_named(self):
        root = self.tree({"src/engine/window.cpp": "#include <pulseloco/group/group.h>\n"})
        result = run(root)
        self.assertEqual(result.returncode, 1)
        self.assertIn("src/engine/window.cpp:1: pulseloco_engine (src/engine) may not use group",
                      result.stdout)

    def test_a_forbidden_library_is_named(self):
        root = self.tree({"transport/tcp/x.cpp": "// text\n#include <mpi.h>\n",
                          "collectives/y.h": "#include <zstd.h>\n"})
        result = run(root)
        self.assertEqual(result.returncode, 1)
        self.assertIn("transport/tcp/x.cpp:2: pulseloco_transport (transport) may not use MPI",
                      result.stdout)
        self.assertIn("collectives/y.h:1: pulseloco_collectives (collectives) may not use zstd",
                      result.stdout)

    def test_the_design_table_must_match(self):
        root = self.tree({"docs/design.md": "| target | folder | may use | never uses |\n"})
        result = subprocess.run([sys.executable, CHECKER, "--root", root, "--design",
                                 root / "docs/design.md"], capture_output=True, text=True,
                                check=False)
        self.assertEqual(result.returncode, 1)
        self.assertIn("the layer table differs", result.stdout)


if __name__ == "__main__":
    unittest.main()
