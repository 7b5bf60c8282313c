"""Each role installs into a fresh virtual environment exactly as its image does, and runs from it.

The images' build stage copies the sources the Dockerfile's COPY lines name and runs
`sh docker/install.sh ROLE /src /opt/kuberl`; this test copies the same sources (minus what
.dockerignore drops) and runs the same script into a temp dir, one venv per role, all four at once.
Differences from an image build, on purpose: the venvs are created by this interpreter's base Python
rather than python:3.11-slim, and TORCH_INDEX_URL is empty (pip's configured index and wheel cache
supply torch here; the images default to PyTorch's CPU index).

Then: `python -m services.<role> --help` answers; the buffer's and the planner's environments hold no
torch (nor gymnasium); the actor's and the learner's make the env of every config that ships (each
kustomize overlay's and the Helm chart's ConfigMap, configs/*.yaml, which docs/deploy.md gives the chart);
and the buffer, learner and actor started from their own environments, with the
args and config the kustomize base renders (the learner alone, `--membership=fixed`: no API server here),
report SERVING to the images' HEALTHCHECK command, train together, and exit 0 on SIGTERM within their
pods' terminationGracePeriodSeconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.cli.stats import get_stats
from tests.deploy.render import (OVERLAYS, ROLES, ROOT, container, expand_vars, helm_template, kustomize, of_kind,
                                  pod_env, workloads)
from tests.deploy.test_crosscheck import dockerfile

INSTALL_TIMEOUT_S = 600
# The module's first test carries the four installs (its fixture's setup: about 50 s alone, 100-170 s beside
# the rest of `make test`); they are what an image build does, and nothing cheaper checks it.
pytestmark = pytest.mark.over_60s("installs the four roles' virtual environments with pip, once for the module")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def copy_build_context(role: str, dest: Path) -> None:
    """Copy what the role's Dockerfile COPYs (before the install RUN) from the repository into `dest`."""
    for op, rest in dockerfile(role)["build"]:
        if op != "COPY":
            continue
        *sources, target = rest.split()
        for src in sources:
            to = dest / src if target in ("./", ".") else dest / target
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, to, ignore=IGNORED)
            else:
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, to)


def install(role: str, base: Path) -> tuple[Path, float, str]:
    src, venv = base / f"src-{role}", base / f"venv-{role}"
    copy_build_context(role, src)
    env = {**os.environ, "PYTHON": sys._base_executable, "TORCH_INDEX_URL": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    proc = subprocess.run(["sh", str(src / "docker" / "install.sh"), role, str(src), str(venv)], env=env,
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    return venv, time.monotonic() - started, proc.stdout[-3000:] + proc.stderr[-3000:] if proc.returncode else ""


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """role -> its venv; the four installs run concurrently (pip mostly copies local wheels)."""
    base = tmp_path_factory.mktemp("roles")
    with ThreadPoolExecutor(len(ROLES)) as pool:
        results = dict(zip(ROLES, pool.map(lambda r: install(r, base), ROLES)))
    failed = {role: log for role, (_, _, log) in results.items() if log}
    assert not failed, f"install.sh failed: {failed}"
    print("install seconds:", {role: round(t, 1) for role, (_, t, _) in results.items()})
    return {role: venv for role, (venv, _, _) in results.items()}


def run_py(venv: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=venv.parent, env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})


@pytest.mark.parametrize("role", ROLES)
def test_role_installs_alone_and_answers_help(venvs, role):
    venv = venvs[role]
    out = run_py(venv, "-m", f"services.{role}", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: kuberl {role}")
    # It runs from the venv's own copy, not from this checkout.
    where = run_py(venv, "-c", "import services, kuberl.v1; print(services.__file__)").stdout.strip()
    assert where.startswith(str(venv)), where
    present = json.loads(run_py(venv, "-c", "import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) "
                                            "is not None for m in ('torch', 'gymnasium', 'ale_py', 'kubernetes')}))").stdout)
    torch_roles = role in ("actor", "learner")
    assert present == {"torch": torch_roles, "gymnasium": torch_roles, "ale_py": torch_roles,
                       "kubernetes": role == "planner"}, f"{role}: {present}"


# Each config's policies' spaces, from the env the config names (made once, as the actor and the learner
# make it); one line per config: "ok NAME" or "FAIL NAME: the error".
SPACES = """
import sys
from services.common.envs import policy_specs
from services.config import load_config
for path in sys.argv[1:]:
    try:
        specs = policy_specs(load_config(path))
        print("ok", path, sorted(specs))
    except Exception as err:
        print("FAIL", path, f"{type(err).__name__}: {err}")
"""


def shipped_configs(dest: Path) -> list[Path]:
    """Every experiment config that ships: each overlay's and the chart's kuberl-config, and configs/*.yaml."""
    rendered = {f"kustomize-{o.replace('/', '-')}": kustomize(o) for o in OVERLAYS} | {"helm": helm_template()}
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    for name, objects in rendered.items():
        (cm,) = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("kuberl-config")]
        paths.append(dest / f"{name}.yaml")
        paths[-1].write_text(cm["data"]["config.yaml"])
    return paths


@pytest.mark.parametrize("role", ("actor", "learner"))
def test_actor_and_learner_environments_make_every_shipped_configs_env(venvs, role, tmp_path):
    paths = shipped_configs(tmp_path)
    assert any("mpe2" in p.read_text() for p in paths)   # the several-policies overlay's simple_tag among them
    out = run_py(venvs[role], "-c", SPACES, *map(str, paths))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    failed = [line for line in lines if not line.startswith("ok ")]
    assert not failed and len(lines) == len(paths), "\n".join(failed) or out.stdout


def _start(venv: Path, workload: dict, overrides: dict[str, str], workdir: Path) -> tuple[subprocess.Popen, str]:
    """Start the role from its venv with the manifest's args (flags in `overrides` replaced); returns the
    process and its gRPC address (from --ready-file)."""
    c = container(workload)
    args = [expand_vars(a, pod_env(workload)) for a in c["args"]]
    args = [a for a in args if a.split("=", 1)[0] not in overrides]
    ready = workdir / f"{c['name']}.ready"
    args += [f"{k}={v}" for k, v in overrides.items()] + [f"--ready-file={ready}"]
    with open(workdir / f"{c['name']}.log", "w") as log:
        proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", f"services.{c['name']}", *args], stdout=log,
                                stderr=log, cwd=workdir,
                                env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, f"{c['name']} exited {proc.returncode}:\n{(workdir / (c['name'] + '.log')).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{c['name']} did not start in 120 s"
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["address"]


def _healthcheck(venv: Path, role: str, address: str) -> subprocess.CompletedProcess:
    """The image's HEALTHCHECK command, pointed at `address` instead of 127.0.0.1:<default port>."""
    (cmd,) = [rest for op, rest in dockerfile(role)["runtime"] if op == "HEALTHCHECK"]
    argv = json.loads(cmd.split("CMD ", 1)[1])
    argv = [address if a.startswith("127.0.0.1:") else a for a in argv]
    return run_py(venv, str(venv / "bin" / argv[0]), *argv[1:], timeout_s=30)


def test_roles_serve_from_their_own_environments(venvs, tmp_path):
    rendered = kustomize("base")
    ws = workloads(rendered)
    (cm,) = of_kind(rendered, "ConfigMap")
    config = tmp_path / "config.yaml"
    config.write_text(cm["data"]["config.yaml"])
    common = {"--config": str(config), "--listen": "127.0.0.1:0", "--metrics-listen": "127.0.0.1:0"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["buffer"], buffer = _start(venvs["buffer"], ws["buffer"], common, tmp_path)
        # One learner, alone: --membership=statefulset would read its StatefulSet's scale from an API server.
        procs["learner"], learner = _start(venvs["learner"], ws["learner"], {
            **common, "--buffer": buffer, "--checkpoint-dir": str(tmp_path / "checkpoints"), "--membership": "fixed"},
            tmp_path)
        procs["actor"], actor = _start(venvs["actor"], ws["actor"], {
            **common, "--buffer": buffer, "--learner": learner}, tmp_path)
        for role, address in (("buffer", buffer), ("learner", learner), ("actor", actor)):
            check = _healthcheck(venvs[role], role, address)
            assert check.returncode == 0 and "SERVING" in check.stdout, (role, check.stdout, check.stderr)
        with grpc.insecure_channel(learner) as channel:   # they train together
            deadline = time.monotonic() + 60
            while get_stats(channel).metrics.get("learner/policy_version", 0) < 2:
                assert time.monotonic() < deadline, "the learner made no updates in 60 s"
                time.sleep(0.5)
        # SIGTERM, as the kubelet sends it: each exits 0 well within its pod's grace period.
        for role in ("actor", "learner", "buffer"):
            grace = ws[role]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            started = time.monotonic()
            procs[role].send_signal(signal.SIGTERM)
            assert procs.pop(role).wait(grace) == 0, (tmp_path / f"{role}.log").read_text()[-3000:]
            assert time.monotonic() - started < grace
        assert list((tmp_path / "checkpoints").iterdir()), "the learner wrote no checkpoint on SIGTERM"
        stopped = _healthcheck(venvs["buffer"], "buffer", buffer)
        assert stopped.returncode == 1 and "UNAVAILABLE" in stopped.stderr   # HEALTHCHECK fails when it is gone
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
