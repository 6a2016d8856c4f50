"""A real local Redis/Valkey Cluster for tests (3 primaries + 3 replicas on
127.0.0.1), started by ``scripts/redis_cluster.sh``; single nodes can be killed,
restarted, filled or have a slot migrated."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "redis_cluster.sh")


def server_binary() -> Optional[str]:
    """valkey-server or redis-server, whichever is installed (None: neither)."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


class LocalCluster:
    """``scripts/redis_cluster.sh start DIR`` and the nodes it started.

    Args:
        workdir: where the nodes keep their logs and ``nodes.conf``.
    """

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.url: Optional[str] = None
        self.pids: Dict[int, int] = {}
        self._args: Dict[int, List[str]] = {}

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        out = subprocess.run([SCRIPT, "start", self.workdir], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{SCRIPT} start failed ({out.returncode}): {out.stderr[-2000:]}")
        self.url = out.stdout.strip().splitlines()[-1]
        self._read_nodes()
        return self

    def _read_nodes(self) -> None:
        self.pids = {}
        with open(os.path.join(self.workdir, "nodes.txt")) as f:
            for line in f:
                port, pid = line.split()
                self.pids[int(port)] = int(pid)

    @property
    def cluster_url(self) -> str:
        """The tier's URL (``redis+cluster://127.0.0.1:PORT``)."""
        return self.url.replace("redis://", "redis+cluster://")

    def client(self, port: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)

    def cluster_client(self):
        import redis

        return redis.RedisCluster.from_url(self.url, socket_timeout=2)

    def alive(self) -> List[int]:
        return [p for p, pid in self.pids.items() if pid and _alive(pid)]

    def nodes(self) -> List[dict]:
        """``CLUSTER NODES`` from a live node: [{id, port, role, primary_id, slots, failed}]."""
        for port in self.alive():
            try:
                text = self.client(port).execute_command("CLUSTER", "NODES")
            except Exception:
                continue
            if isinstance(text, bytes):
                text = text.decode()
            out = []
            for line in text.strip().splitlines():
                f = line.split()
                flags = f[2].split(",")
                out.append({"id": f[0], "port": int(f[1].split("@")[0].rsplit(":", 1)[1]),
                            "role": "primary" if "master" in flags else "replica",
                            "primary_id": None if f[3] == "-" else f[3], "slots": f[8:],
                            "failed": "fail" in flags})
            return out
        raise RuntimeError("no cluster node answers")

    def primaries(self) -> List[int]:
        return sorted(n["port"] for n in self.nodes() if n["role"] == "primary" and not n["failed"]
                      and n["port"] in self.alive())

    def port_of_slot(self, slot: int) -> int:
        for port in self.alive():
            try:
                for lo, hi, *nodes in self.client(port).execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        return int(nodes[0][1])
            except Exception:
                continue
        raise RuntimeError(f"no node serves slot {slot}")

    def node_id(self, port: int) -> str:
        return self.client(port).execute_command("CLUSTER", "MYID").decode()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and all 16384 slots
        are served by live primaries."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ok = all(self.client(p).cluster("info")["cluster_state"] == "ok" for p in self.alive())
                if ok:
                    covered = 0
                    live = set(self.alive())
                    for lo, hi, *nodes in self.client(next(iter(live))).execute_command("CLUSTER", "SLOTS"):
                        if int(nodes[0][1]) in live:
                            covered += hi - lo + 1
                    if covered == 16384 and all(self.synced(p) for p in live):
                        return
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError("the cluster did not become ok")

    def synced(self, port: int) -> bool:
        """A primary, or a replica whose link is up and whose offset reached its primary's."""
        info = self.client(port).info("replication")
        if info.get("role") == "master":
            return True
        if info.get("master_link_status") != "up":
            return False
        prim = self.client(int(info["master_port"])).info("replication")
        return int(info.get("slave_repl_offset", -1)) >= int(prim.get("master_repl_offset", 0))

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        pid = self.pids.get(port)
        if pid:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            for _ in range(200):
                if not _alive(pid):
                    break
                time.sleep(0.01)
            self.pids[port] = 0

    def restart(self, port: int) -> None:
        """Start a killed node again on its port (it rejoins from its nodes.conf)."""
        server = server_binary()
        nd = os.path.join(self.workdir, f"n{port}")
        log = open(os.path.join(self.workdir, f"node-{port}.log"), "ab")
        p = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
                              "--cluster-config-file", os.path.join(nd, "nodes.conf"), "--cluster-node-timeout",
                              "1000", "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0", "--save", "", "--appendonly", "no", "--dir", nd, "--daemonize", "no",
                              "--protected-mode", "no"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.pids[port] = p.pid
        with open(os.path.join(self.workdir, "nodes.txt"), "w") as f:
            for pt, pid in self.pids.items():
                f.write(f"{pt} {pid}\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self.client(port).ping()
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"node {port} did not restart")

    def migrate_slot(self, slot: int, dst_port: int, batch: int = 100) -> int:
        """Move ``slot`` to the primary on ``dst_port`` the way
        ``redis-cli --cluster reshard`` does (IMPORTING/MIGRATING, MIGRATE
        of its keys, SETSLOT NODE on both); returns the keys moved."""
        src_port = self.port_of_slot(slot)
        src, dst = self.client(src_port), self.client(dst_port)
        src_id, dst_id = self.node_id(src_port), self.node_id(dst_port)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        for c in (dst, src):
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved

    def stop_all(self) -> None:
        """Kill every node (the whole cluster is gone; :meth:`ensure_running` starts a new one)."""
        for port in list(self.pids):
            self.kill(port)

    def ensure_running(self) -> "LocalCluster":
        """Start a fresh cluster (new ports, empty) when a node is missing and
        cannot be put back: after :meth:`stop_all`, or a test that failed
        before restarting what it killed."""
        if self.pids and all(self.pids.values()) and len(self.alive()) == len(self.pids):
            return self
        self.stop()
        return self.start()

    def stop(self) -> None:
        subprocess.run([SCRIPT, "stop", self.workdir], capture_output=True, timeout=60)
        self.pids = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
