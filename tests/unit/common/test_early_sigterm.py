"""A role asked to stop while it is still importing exits 0, not -15 (what supervisors read as a crash)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ROLES = ("actor", "buffer", "learner", "planner")


def test_sigterm_before_serving_exits_zero():
    code = ("import os, signal, time\n"
            "from services.common.service.runtime import stop_cleanly_until_serving\n"
            "stop_cleanly_until_serving()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n"          # a long import, as torch's; the signal ends it at once
            "raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)


def test_without_it_the_same_stop_reads_as_a_crash():
    code = "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -15


@pytest.mark.parametrize("role", ROLES)
def test_every_role_installs_it_before_importing_its_service(role):
    body = ast.parse((ROOT / "services" / role / "__main__.py").read_text()).body
    calls = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "id", "") == "stop_cleanly_until_serving"]
    service = [i for i, node in enumerate(body) if isinstance(node, ast.ImportFrom)
               and node.module == f"services.{role}.main"]
    assert calls and service and calls[0] < service[0], f"services/{role}/__main__.py"
