"""Fixtures of the end-to-end tests: a real single-node cluster and the project's images built into it.

Opt-in: these run under `make e2e` (KUBERL_E2E=1), never under `make test`; elsewhere every test here
skips and says so. Each fixture skips with the reason where a piece cannot be had (no root, a package
or binary missing: see tests/e2e/provision.sh), and fails with the component's log where it could be
had but did not work. `make e2e` sets KUBERL_E2E_REQUIRE=1, which turns those skips into failures: a
`make e2e` that passes has run every test (KUBERL_E2E_REQUIRE=0 to allow the skips).

    e2e_node     session   a started tests/e2e/node.Node (torn down at the end of the session)
    e2e_images   session   the four role images built into the node's dockerd (docker/build-images.sh,
                           offline, on the mmdebstrap base); returns their tags
    e2e_report   session   a dict the tests add measurements to; written to $KUBERL_E2E_REPORT
                           (default runs/e2e/report.json) at the end
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.node import BASE_IMAGE, E2E_CACHE, Node, Unavailable, image_tags, iptables_rules, sweep

ROOT = Path(__file__).resolve().parents[2]
REPORT = Path(os.environ.get("KUBERL_E2E_REPORT", ROOT / "runs" / "e2e" / "report.json"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KUBERL_E2E") == "1":
        return
    skip = pytest.mark.skip(reason="end-to-end tests on a real node are opt-in: run `make e2e` (KUBERL_E2E=1)")
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_report():
    report: dict = {}
    yield report
    if report:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(REPORT.read_text()) if REPORT.exists() else {}
        REPORT.write_text(json.dumps({**old, **report}, indent=2) + "\n")


@pytest.fixture(scope="session")
def e2e_node(tmp_path_factory, e2e_report):
    reasons = (E2E_CACHE / "unavailable").read_text().strip() if (E2E_CACHE / "unavailable").exists() else ""
    if os.geteuid() == 0:
        for line in sweep():   # before the snapshot: what a killed run left is not "before"
            print(f"[e2e] swept what an earlier run left: {line}")
    iptables_before = iptables_rules() if os.geteuid() == 0 else []
    node = Node(tmp_path_factory.mktemp("node"))
    start = time.monotonic()
    try:
        node.start()
    except Unavailable as e:
        node.stop()
        why = f"no e2e node: {e}" + (f" ({reasons})" if reasons else "")
        if os.environ.get("KUBERL_E2E_REQUIRE") == "1":   # `make e2e`: a run that proves nothing fails
            pytest.fail(f"{why}; KUBERL_E2E_REQUIRE=0 makes this a skip")
        pytest.skip(why)
    except BaseException:
        node.stop()
        raise
    e2e_report["node_start_s"] = round(time.monotonic() - start, 1)
    try:
        yield node
    finally:
        node.stop()
    left = iptables_rules()
    e2e_report["teardown_left_iptables_rules"] = sorted(set(left) - set(iptables_before))
    assert left == iptables_before, (f"teardown left iptables changed: added {sorted(set(left) - set(iptables_before))}, "
                                     f"removed {sorted(set(iptables_before) - set(left))}")


@pytest.fixture(scope="session")
def e2e_images(e2e_node, e2e_report):
    base_tar = E2E_CACHE / "base-bookworm-python3.tar"
    if e2e_node.docker("image", "inspect", BASE_IMAGE, check=False).returncode != 0:
        if not base_tar.exists():
            (pytest.fail if os.environ.get("KUBERL_E2E_REQUIRE") == "1" else pytest.skip)(f"no base image: {base_tar} is missing (tests/e2e/provision.sh makes it with mmdebstrap)")
        with open(base_tar, "rb") as f:
            e2e_node.docker("import", "--change", "ENV LANG=C.UTF-8", "-", BASE_IMAGE, stdin=f)
    report = e2e_node.workdir / "images.json"
    start = time.monotonic()
    env = {**os.environ, "DOCKER": "docker", "DOCKER_HOST": e2e_node.docker_host, "PYTHON_IMAGE": BASE_IMAGE,
           "IMAGES_REPORT": str(report),
           # torch from what the host's pip is configured with (the CPU wheel on these machines)
           "TORCH_INDEX_URL": os.environ.get("KUBERL_E2E_TORCH_INDEX_URL", "")}
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build-images.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, f"docker/build-images.sh failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    e2e_report["images"] = json.loads(report.read_text())
    e2e_report["images_build_s"] = round(time.monotonic() - start, 1)
    return image_tags()
