"""The layout: one import namespace, rooms that meet only where they should."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imports(folder: str) -> set[str]:
    """Every module name imported by the .py files of a repository folder."""
    names = set()
    for path in (REPO / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_the_two_processes_meet_only_in_core_and_proto():
    verifier, drafter = _imports("verifier_service"), _imports("drafter_service")
    assert not [m for m in verifier if m.startswith(("specserve.drafter", "drafter_service"))]
    assert not [m for m in drafter if m.startswith(("specserve.verifier", "verifier_service"))]


def test_serving_rooms_do_not_import_training_or_benchmarks():
    for folder in ("specserve", "core", "proto", "drafter_service", "verifier_service", "cluster"):
        bad = [m for m in _imports(folder) if m.startswith(("specserve.training", "specserve.benchmarks"))
               and not (folder == "specserve")]  # the CLI imports them lazily, by name, as subcommands
        assert not bad, (folder, bad)


def test_no_old_top_level_import_names_remain():
    for folder in ("specserve", "core", "proto", "drafter_service", "verifier_service", "cluster", "training",
                   "benchmarks", "tests"):
        old = [m for m in _imports(folder)
               if m.split(".")[0] in ("proto", "cluster", "drafter_service", "verifier_service", "core")]
        assert not old, (folder, old)


def test_the_wheel_installs_only_the_specserve_namespace(tmp_path):
    """What `pip install` of the wheel adds to site-packages: `specserve/` and its dist-info, nothing
    generic such as `proto` or `cluster` at the top level."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("specserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"specserve", next(t for t in top if t.endswith(".dist-info"))}, top
    for module in ("specserve/core/runner.py", "specserve/proto/speculative_pb2.py", "specserve/proto/speculative.proto",
                   "specserve/drafter/server.py", "specserve/verifier/acceptance.py", "specserve/cluster/serve_app.py",
                   "specserve/training/distill.py", "specserve/benchmarks/bench.py", "specserve/cli.py"):
        assert module in names, module
