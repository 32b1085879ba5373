"""``init_ray``'s local Ray listens on loopback only: every TCP socket that its driver, GCS, raylet (with its object
manager), agents and workers listen on, and every node address on their command lines, is 127.0.0.1; a process a
worker starts joins it by that address, as NeMo-Gym's servers do.

The Ray starts in a subprocess, so the session Ray (if this worker has one) is untouched.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

_PROBE = r"""
import json, subprocess, sys, time
import psutil, ray
from gym_bridge.ray_utils import init_ray

JOIN = "import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); print(ray.get_runtime_context().gcs_address)"

@ray.remote
def join_from_worker(address):
    done = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True, timeout=180)
    return done.returncode, done.stdout.strip().splitlines()[-1:] , done.stderr[-2000:]

init_ray(num_cpus=1)
try:
    gcs = ray.get_runtime_context().gcs_address
    joined = ray.get(join_from_worker.remote(gcs), timeout=240)
    time.sleep(1)
    me = psutil.Process()
    procs = {p.pid: p for p in [me, *me.children(recursive=True)]}
    names, cmdlines = {}, {}
    for pid, proc in procs.items():
        try:
            names[pid], cmdlines[pid] = proc.name(), proc.cmdline()
        except psutil.Error:
            pass
    sockets = [
        {"pid": c.pid, "name": names.get(c.pid, "?"), "type": c.type.name, "ip": c.laddr.ip, "port": c.laddr.port}
        for c in psutil.net_connections(kind="inet")
        if c.pid in procs and c.laddr and (c.status == psutil.CONN_LISTEN or c.type.name == "SOCK_DGRAM")
    ]
    print(json.dumps({"gcs": gcs, "joined": joined, "sockets": sockets, "cmdlines": list(cmdlines.values())}))
finally:
    ray.shutdown()
"""

_NODE_ADDRESS_FLAGS = ("--node-ip-address=", "--node_ip_address=", "--monitor-ip=", "--node-manager-address=")


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_init_ray_listens_on_loopback_only() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=540, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])

    sockets = found["sockets"]
    exposed = [s for s in sockets if not _loopback(s["ip"])]
    assert not exposed, f"Ray listens beyond loopback: {exposed}"
    listening = {s["name"] for s in sockets}
    assert {"gcs_server", "raylet"} <= listening, f"no GCS or raylet listener found: {sockets}"

    assert found["gcs"].startswith("127.0.0.1:"), found["gcs"]
    code, out, err = found["joined"]
    assert code == 0 and out == [found["gcs"]], f"a worker's subprocess did not join by {found['gcs']}: {err}"

    addresses = {
        arg.split("=", 1)[1] for cmdline in found["cmdlines"] for arg in cmdline if arg.startswith(_NODE_ADDRESS_FLAGS)
    }
    assert addresses == {"127.0.0.1"}, f"node addresses on Ray's command lines: {addresses}"
