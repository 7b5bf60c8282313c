"""kuberl's Grafana dashboard (k8s/helm/kuberl/dashboards/kuberl.json) against a real Prometheus
(Debian's package, tests/k8s/provision.sh) scraping a `kuberl up` run through the run's
prometheus-targets.json (file_sd_configs): every query of every panel returns data.

The run is DQN (a replay, so the replay-ratio panel has a target) with the planner on (its decisions,
bottleneck and replica panels), its env an external simulator's: a CartPole simulator connected over
EnvSession (kuberl_client.gym.serve_gym_env, in a thread) feeds the per-session panels. Grafana's
variables are given the values Grafana would: `$namespace` All (`.*`, which also matches series
without the label, as a local run's are) and `$__rate_interval` a few scrape intervals.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.helpers import ROOT, TINY_DQN, wait_for, write_config
from tests.k8s.cluster import Unavailable, binaries, free_port

DASHBOARD = ROOT / "k8s" / "helm" / "kuberl" / "dashboards" / "kuberl.json"
SCRAPE_S = 1
VARIABLES = {"$namespace": ".*", "$__rate_interval": f"{4 * SCRAPE_S}s"}


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables filled in) for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a variable the test does not fill in: {expr}"
            out.append((panel["title"], expr))
    return out


def query(address: str, expr: str) -> list:
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def simulate(address: str, stop: threading.Event) -> None:
    """A CartPole simulator stepping over EnvSession until `stop` (it waits for the actor to serve)."""
    import gymnasium as gym

    from kuberl_client.gym import serve_gym_env

    envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    try:
        serve_gym_env(envs, address, session_id="dashboard-sim", stop=stop, seed=0, timeout_s=120)
    finally:
        envs.close()


def test_every_dashboard_query_returns_data_from_a_kuberl_up_run(tmp_path):
    try:
        prometheus = binaries("PROMETHEUS")["PROMETHEUS"]
    except Unavailable as e:
        pytest.skip(f"no Prometheus: {e}")
    config = write_config(tmp_path / "c.yaml", {
        **TINY_DQN, "env": {"id": "CartPole-v1", "mode": "external"}, "topology": {"actors": 1},
        "planner": {"enabled": True, "interval_s": 1, "warmup_s": 1, "actor": {"min": 1, "max": 2}},
        "run": {"target_return": None, "poll_interval_s": 0.2}})
    run = tmp_path / "run"
    actor_port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet", "--actor-port", str(actor_port)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom, stop = None, threading.Event()
    simulator = threading.Thread(target=simulate, args=(f"127.0.0.1:{actor_port}", stop), daemon=True)
    try:
        simulator.start()
        targets = run / "prometheus-targets.json"

        def every_role_listed() -> bool:
            try:
                roles = {g["labels"]["role"] for g in json.loads(targets.read_text())}
            except (OSError, ValueError):
                return False
            return roles == {"actor", "buffer", "learner", "planner"}
        wait_for(every_role_listed, timeout=180, interval=0.5, what=f"every role in {targets}")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [{"job_name": "kuberl", "file_sd_configs": [{"files": [str(targets)]}]}]}))
        address = f"127.0.0.1:{free_port()}"
        prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={address}",
                                 "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        every = queries()
        assert len(every) >= 40
        missing: list[tuple[str, str]] = []

        def all_answer() -> bool:
            missing[:] = []
            try:
                up_targets = query(address, 'up{job="kuberl"}')
                if not up_targets or any(r["value"][1] != "1" for r in up_targets):
                    missing.append(("scrape targets up", json.dumps(up_targets)))
                    return False
                for title, expr in every:
                    if not query(address, expr):
                        missing.append((title, expr))
            except OSError:   # Prometheus not listening yet
                missing.append(("prometheus", "not answering"))
                return False
            return not missing
        wait_for(all_answer, timeout=240, interval=2,
                 what=lambda: "every dashboard query answered; no data for:\n" + "\n".join(f"  {t}: {e}" for t, e in missing))
        scraped = {r["metric"]["role"] for r in query(address, 'up{job="kuberl"}')}
        assert scraped == {"actor", "buffer", "learner", "planner"}, scraped
        assert up.poll() is None, "kuberl up ended before the queries were made"
        sessions = {r["metric"]["session"] for r in query(address, "kuberl_actor_session_envs")}
        assert sessions == {"dashboard-sim"}, sessions
    finally:
        stop.set()
        simulator.join(timeout=60)
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                up.kill()
    assert json.loads((run / "summary.json").read_text())["reason"] == "interrupted"
