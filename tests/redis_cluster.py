"""A real Redis Cluster on loopback ports, for the tests (no Docker).

Three masters from the machine's ``redis-server`` (and a replica each when
asked), created with ``redis-cli --cluster create``; nothing is kept on disk.
docs/CONTRIBUTING.md has the facts this relies on (about 2 s to form, about 2 s to
fail over with a 1 s node timeout).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from .faultinjection import free_port, wait_for_ping


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            try:
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


class RedisClusterHarness:
    def __init__(self, workdir: Path, *, masters: int = 3, replicas: int = 0) -> None:
        binary = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed "
                               "(apt-get install redis-server).")
        self.binary, self.cli = binary, cli
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.ports = [_free_cluster_port() for _ in range(masters * (1 + replicas))]
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The URL the backend takes: any node; the client discovers the rest."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port in self.ports:
            self._start_node(port)
        subprocess.run(
            [self.cli, "--cluster", "create",
             *(f"127.0.0.1:{port}" for port in self.ports),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        self.wait_ok()

    def _start_node(self, port: int) -> None:
        node_dir = self.workdir / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
             "--cluster-node-timeout", "1000", "--save", "", "--appendonly", "no",
             "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
             "--dir", str(node_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        wait_for_ping(port)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node says cluster_state:ok and all slots are covered."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for port, proc in self.processes.items():
                if proc.poll() is not None:
                    continue
                try:
                    info = redis.Redis(port=port, decode_responses=True).cluster("info")
                    states.append(info.get("cluster_state") == "ok"
                                  and int(info.get("cluster_slots_ok", 0)) == 16384)
                except redis.RedisError:
                    states.append(False)
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not ok after {timeout} s")
            time.sleep(0.1)

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0], decode_responses=True)

    def master_port_of(self, key: str) -> int:
        """The port of the master that owns ``key``'s slot now."""
        node = self.client().get_node_from_key(key)
        return int(node.port)

    def kill(self, port: int) -> None:
        proc = self.processes[port]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.processes):
            self.kill(port)
