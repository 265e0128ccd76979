"""A real Redis Cluster for the tests and the benches: ``redis-server`` processes on 127.0.0.1.

By default 3 masters and 3 replicas (``--cluster-enabled yes``), each node in its own temporary
directory, created with ``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``, as an
operator would. ``start()`` returns once every node says ``cluster_state:ok``, every node maps every
slot to the same live master, and every replica's link to its master is up (so ``WAIT 1 0`` and a
failover work from the first command). No persistence unless asked (``persistence=True``: AOF
fsynced every second, as Sluice's compose and k8s Redis run).

Faults: ``kill_master(slot_or_key)`` SIGKILLs the master that owns a key's slot,
``wait_for_failover()`` waits until one of its replicas serves its slots and every live node agrees,
``restart_node(node)`` brings a node back on its ports and directory (it keeps its node id from
``nodes.conf``; a replaced master rejoins as a replica of its successor), ``heal()`` restarts every
dead node.

Auth: ``password=`` sets ``requirepass``/``masterauth`` on every node; ``username=`` with it creates
that ACL user (all keys, channels and commands), disables the ``default`` user and makes replicas
authenticate as the user (``masteruser``). ``url`` carries the credentials:
``redis+cluster://[user:password@]127.0.0.1:p1,127.0.0.1:p2,...``.

TLS: ``tls=True`` serves clients, the cluster bus and replication over TLS only (no plain port),
with a throwaway CA made by the openssl command (``ca_cert``); ``url`` is then
``rediss+cluster://...``. A process that verifies with the default CA store (``ssl=True``, as a
``rediss`` URL gives) trusts the nodes when ``SSL_CERT_FILE`` names ``ca_cert``.

Ports: every node's client port and cluster-bus port are two free ports picked by the OS, the bus
set with ``--cluster-port`` (Redis >= 7.0) rather than the implicit port + 10000, which for an
ephemeral port often lies above 65535 or on something else. A port taken between the pick and the
bind (the log says "Address already in use") is picked again.

``redis-server``/``redis-cli`` must be Redis >= 7 (sharded pub/sub); ``.ci/setup-docker.sh`` installs
them. Without them ``start()`` raises ``ClusterUnavailable`` with what to run; the pytest fixtures
(``tests/cluster_fixtures.py``) turn that into a failure, never a skip.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.cluster import ClusterNode
from redis.crc import key_slot

from tests.docker_support import free_ports

HOST = "127.0.0.1"
SLOTS = 16384
REDIS_SERVER = os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server")
REDIS_CLI = os.environ.get("SLUICE_TEST_REDIS_CLI", "redis-cli")
MIN_MAJOR = 7
SETUP_HINT = (
    "A Redis Cluster test needs redis-server and redis-cli >= 7 on PATH: run `.ci/setup-docker.sh` "
    "(as root) or `apt-get install -y redis-server`."
)
_POLL_S = 0.02


class ClusterUnavailable(RuntimeError):
    """The cluster could not be started; the message says why and what to do."""


def _make_certificates(directory: Path) -> Path:
    """A throwaway CA and a node certificate it signs, for 127.0.0.1 and localhost (openssl CLI)."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("openssl") is None:
        raise ClusterUnavailable("a TLS cluster needs the openssl command (apt-get install -y openssl)")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=sluice-test-ca"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.crt", "-days", "2", "-extfile", "san.ext"],
    ]
    for step in steps:
        proc = subprocess.run(["openssl", *step], cwd=directory, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"openssl {' '.join(step[:2])} failed: {proc.stderr.strip()}")
    (directory / "server.key").chmod(0o600)
    return directory


def redis_server_version(binary: str = REDIS_SERVER) -> tuple[int, ...]:
    """``redis-server --version`` as a tuple, or ClusterUnavailable when it is missing."""
    path = shutil.which(binary)
    if path is None:
        raise ClusterUnavailable(f"{binary!r} is not installed. {SETUP_HINT}")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise ClusterUnavailable(f"cannot read the version of {path}: {out!r}. {SETUP_HINT}")
    return tuple(int(g) for g in match.groups())


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES`` as some node sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    link_state: str
    slots: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, line: str) -> NodeView:
        parts = line.split()
        address = parts[1].split("@")[0].split(",")[0]
        slots = []
        for item in parts[8:]:
            if item.startswith("["):  # a slot being migrated or imported: not owned yet
                continue
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        return cls(
            node_id=parts[0],
            port=int(address.rpartition(":")[2] or 0),
            flags=frozenset(parts[2].split(",")),
            master_id=None if parts[3] == "-" else parts[3],
            link_state=parts[7],
            slots=tuple(slots),
        )

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "noaddr", "handshake"})


@dataclass(eq=False)
class Node:
    """One ``redis-server`` of the cluster."""

    port: int
    bus_port: int
    dir: Path
    node_id: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass(frozen=True)
class _Killed:
    """A master killed by ``kill_master``: what ``wait_for_failover`` waits for its replicas to take."""

    node: Node
    slots: tuple[tuple[int, int], ...]
    replica_ids: frozenset[str]


_LIVE: set[LocalRedisCluster] = set()  # started and not stopped (strong: a dropped object still stops)


@atexit.register
def _stop_leftovers() -> None:
    """No redis-server outlives the test process, whatever a test forgot."""
    for cluster in list(_LIVE):
        cluster.stop()


class LocalRedisCluster:
    """A Redis Cluster of ``masters * (1 + replicas_per_master)`` local redis-server processes."""

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 1,
        *,
        password: str | None = None,
        username: str | None = None,
        persistence: bool = False,
        tls: bool = False,
        node_timeout_ms: int = 2000,
        base_dir: str | os.PathLike[str] | None = None,
        redis_server: str = REDIS_SERVER,
        redis_cli: str = REDIS_CLI,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if username is not None and not password:
            raise ValueError("an ACL user needs a password")
        self.masters_count = masters
        self.replicas_per_master = replicas_per_master
        self.password = password
        self.username = username
        self.persistence = persistence
        self.tls = tls
        self.tls_dir: Path | None = None  # ca.crt, server.crt, server.key once started with tls
        self.node_timeout_ms = node_timeout_ms
        self.redis_server = redis_server
        self.redis_cli = redis_cli
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._own_dir: Path | None = None
        self.nodes: list[Node] = []
        self.startup_s: float | None = None  # wall time of the last start(), for reports
        self._killed: _Killed | None = None
        self._clients: dict[tuple[int, int | None], redis.Redis] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalRedisCluster:
        """Start every node, create the cluster and wait until it is whole (see the module doc)."""
        if self.nodes:
            raise RuntimeError("the cluster is already started")
        t0 = time.monotonic()
        deadline = t0 + timeout
        version = redis_server_version(self.redis_server)
        if version[0] < MIN_MAJOR:
            raise ClusterUnavailable(
                f"{self.redis_server} is Redis {'.'.join(map(str, version))}; sharded pub/sub needs "
                f">= {MIN_MAJOR}. {SETUP_HINT}"
            )
        if shutil.which(self.redis_cli) is None:
            raise ClusterUnavailable(f"{self.redis_cli!r} is not installed. {SETUP_HINT}")
        root = self._base_dir or Path(tempfile.mkdtemp(prefix="sluice-redis-cluster-"))
        if self._base_dir is None:
            self._own_dir = root
        _LIVE.add(self)
        try:
            if self.tls:
                self.tls_dir = _make_certificates(root / "tls")
            count = self.masters_count * (1 + self.replicas_per_master)
            ports = free_ports(2 * count)
            for i in range(count):
                node_dir = root / f"node-{i}"
                node_dir.mkdir(parents=True, exist_ok=True)
                self.nodes.append(Node(port=ports[2 * i], bus_port=ports[2 * i + 1], dir=node_dir))
            for node in self.nodes:  # all at once: each takes a few ms, but they overlap
                self._spawn(node)
            for node in self.nodes:
                self._wait_serving(node, deadline)
                node.node_id = str(self._client(node).execute_command("CLUSTER", "MYID"), "ascii")
            self._create(deadline)
            self.wait_converged(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """SIGKILL every node (nothing to save) and remove the directories this object created."""
        for node in self.nodes:
            self._kill(node)
        self.nodes = []
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        _LIVE.discard(self)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- access ----------------------------------------------------------------------------------
    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node, in creation order (the first ones were created masters)."""
        return [(HOST, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://[user:password@]127.0.0.1:p1,127.0.0.1:p2,...`` (every node)."""
        if not self.nodes:
            raise RuntimeError("the cluster is not started")
        auth = ""
        if self.password:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + auth + ",".join(f"{h}:{p}" for h, p in self.startup_nodes)

    @property
    def ca_cert(self) -> Path:
        """The CA that signed the nodes' certificate (``tls=True``): what a client verifies with."""
        if self.tls_dir is None:
            raise RuntimeError("the cluster has no TLS (tls=True)")
        return self.tls_dir / "ca.crt"

    def _tls_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca_cert)} if self.tls else {}

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A ``redis.cluster.RedisCluster`` on this cluster, with its credentials."""
        kwargs.setdefault("password", self.password)
        kwargs.setdefault("username", self.username)
        kwargs = {**self._tls_kwargs(), **kwargs}
        nodes = [ClusterNode(h, p) for h, p in self.startup_nodes]
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)

    def node_client(self, node: Node, **kwargs: Any) -> redis.Redis:
        """A plain ``redis.Redis`` on one node (no redirections followed), with the credentials."""
        kwargs.setdefault("password", self.password)
        kwargs.setdefault("username", self.username)
        kwargs.setdefault("socket_connect_timeout", 2)
        kwargs.setdefault("socket_timeout", 5)
        kwargs = {**self._tls_kwargs(), **kwargs}
        return redis.Redis(host=HOST, port=node.port, **kwargs)

    def node_by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def node_by_id(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)

    def masters(self) -> list[Node]:
        """Live nodes that are masters serving slots (their own view)."""
        return [n for n in self.live_nodes() if self._role(n) == "master" and self._own_view(n).slots]

    def replicas(self) -> list[Node]:
        """Live nodes that are replicas (their own view)."""
        return [n for n in self.live_nodes() if self._role(n) == "slave"]

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def replicas_of(self, master: Node) -> list[Node]:
        return [n for n in self.replicas() if self._own_view(n).master_id == master.node_id]

    @staticmethod
    def slot_of(slot_or_key: int | str | bytes) -> int:
        if isinstance(slot_or_key, int):
            if not 0 <= slot_or_key < SLOTS:
                raise ValueError(f"slot {slot_or_key} is not in 0..{SLOTS - 1}")
            return slot_or_key
        key = slot_or_key.encode() if isinstance(slot_or_key, str) else slot_or_key
        return key_slot(key)

    def master_for(self, slot_or_key: int | str | bytes) -> Node:
        """The live master that serves the slot of ``slot_or_key`` (a slot number or a key)."""
        slot = self.slot_of(slot_or_key)
        for node in self.live_nodes():
            for view in self._views(node):
                if any(lo <= slot <= hi for lo, hi in view.slots) and "master" in view.flags:
                    owner = self.node_by_id(view.node_id)
                    if owner.alive:
                        return owner
        raise LookupError(f"no live master serves slot {slot}")

    # -- faults ----------------------------------------------------------------------------------
    def kill_master(self, slot_or_key: int | str | bytes) -> Node:
        """SIGKILL the master that owns the slot of ``slot_or_key``; returns that node."""
        node = self.master_for(slot_or_key)
        view = self._own_view(node)
        replicas = frozenset(n.node_id for n in self.replicas_of(node))
        self._killed = _Killed(node=node, slots=view.slots, replica_ids=replicas)
        self._kill(node)
        return node

    def wait_for_failover(self, timeout: float = 30.0) -> Node:
        """Wait until a replica of the last killed master is a master and every live node says
        ``cluster_state:ok`` and maps every slot to a live master; returns the promoted node."""
        killed = self._killed
        if killed is None:
            raise RuntimeError("wait_for_failover() follows kill_master()")
        deadline = time.monotonic() + timeout
        while True:
            promoted, problem = self._failover_state(killed)
            if promoted is not None:
                self._killed = None
                return promoted
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no failover of {killed.node.address} within {timeout:.0f} s: {problem}\n{self.describe()}"
                )
            time.sleep(_POLL_S * 5)

    def restart_node(self, node: Node, timeout: float = 30.0) -> Node:
        """Start a dead node again on its ports and directory and wait until the cluster is whole
        with it (it keeps its node id; a replaced master comes back as a replica)."""
        if node.alive:
            raise RuntimeError(f"{node.address} is running")
        deadline = time.monotonic() + timeout
        self._spawn(node)
        self._wait_serving(node, deadline)
        self.wait_converged(timeout=max(1.0, deadline - time.monotonic()))
        return node

    def heal(self, timeout: float = 30.0) -> None:
        """Restart every dead node and wait until the cluster is whole."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if not node.alive:
                self._spawn(node)
        for node in self.nodes:
            self._wait_serving(node, deadline)
        self.wait_converged(timeout=max(1.0, deadline - time.monotonic()))

    def flushall(self, timeout: float = 10.0) -> None:
        """FLUSHALL on every master, then wait until every live node (replicas too) is empty."""
        for node in self.masters():
            self._client(node).flushall()
        deadline = time.monotonic() + timeout
        while True:
            left = {n.address: self._client(n).dbsize() for n in self.live_nodes()}
            if not any(left.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"keys left after FLUSHALL: {left}")
            time.sleep(_POLL_S)

    # -- waiting ---------------------------------------------------------------------------------
    def wait_converged(self, timeout: float = 30.0) -> None:
        """Wait until the cluster is whole: see ``_convergence_problem``."""
        deadline = time.monotonic() + timeout
        while True:
            problem = self._convergence_problem()
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not converge within {timeout:.0f} s: {problem}\n{self.describe()}")
            time.sleep(_POLL_S)

    def describe(self) -> str:
        """Every node's state and the last lines of its log, for failure messages."""
        out = []
        for node in self.nodes:
            state = "alive" if node.alive else "dead"
            out.append(f"--- {node.address} (bus {node.bus_port}, id {node.node_id[:8]}, {state})")
            if node.alive:
                try:
                    out.append(str(self._client(node).execute_command("CLUSTER", "NODES"), "utf-8").strip())
                except redis.RedisError as exc:
                    out.append(f"CLUSTER NODES: {exc}")
            out.append(node.log_tail(8))
        return "\n".join(out)

    # -- internals -------------------------------------------------------------------------------
    def _command(self, node: Node) -> list[str]:
        cmd = [
            self.redis_server,
            *(self._tls_ports(node) if self.tls else ["--port", str(node.port)]),
            "--bind", HOST,
            "--cluster-enabled", "yes",
            "--cluster-port", str(node.bus_port),
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # a replica may always take over, however long its link was down (tests kill freely)
            "--cluster-replica-validity-factor", "0",
            "--dir", str(node.dir),
            "--logfile", str(node.log_path),
            "--daemonize", "no",
            "--save", "",
            # replicas sync at once (the default waits 5 s for more replicas to join a transfer)
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
        ]
        if self.persistence:
            cmd += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            cmd += ["--appendonly", "no"]
        if self.username:
            cmd += ["--user", self.username, "on", f">{self.password}", "~*", "&*", "+@all"]
            cmd += ["--user", "default", "off"]
            cmd += ["--masteruser", self.username, "--masterauth", str(self.password)]
        elif self.password:
            cmd += ["--requirepass", self.password, "--masterauth", self.password]
        return cmd

    def _tls_ports(self, node: Node) -> list[str]:
        """TLS only: no plain port; clients, the cluster bus and replication all over TLS, clients
        not asked for a certificate (they verify the nodes' against ``ca_cert``)."""
        assert self.tls_dir is not None
        return [
            "--port", "0", "--tls-port", str(node.port),
            "--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no",
            "--tls-cert-file", str(self.tls_dir / "server.crt"),
            "--tls-key-file", str(self.tls_dir / "server.key"),
            "--tls-ca-cert-file", str(self.tls_dir / "ca.crt"),
        ]

    def _spawn(self, node: Node) -> None:
        with open(node.dir / "stderr.log", "ab") as stderr:  # the child keeps its own descriptor
            try:
                node.proc = subprocess.Popen(
                    self._command(node), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=stderr, start_new_session=True,
                )
            except OSError as exc:
                raise ClusterUnavailable(f"cannot run {self.redis_server}: {exc}. {SETUP_HINT}") from exc

    def _wait_serving(self, node: Node, deadline: float) -> None:
        """Until the node answers PING. A node not yet in the cluster whose port was taken between
        the pick and the bind is started again on new ports; any other exit is ClusterUnavailable."""
        repicks = 3
        while True:
            if node.proc is None or node.proc.poll() is not None:
                log = node.log_tail()
                if not node.node_id and "Address already in use" in log and repicks > 0:
                    repicks -= 1
                    (node.dir / "nodes.conf").unlink(missing_ok=True)
                    node.log_path.unlink(missing_ok=True)
                    node.port, node.bus_port = free_ports(2)
                    self._spawn(node)
                    continue
                stderr = (node.dir / "stderr.log").read_text(errors="replace").strip()
                raise ClusterUnavailable(
                    f"redis-server on {node.address} (bus {node.bus_port}) exited "
                    f"({node.proc.returncode if node.proc else '-'}):\n{stderr}\n{log}"
                )
            try:
                if self._client(node).ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"redis-server on {node.address} does not answer PING:\n{node.log_tail()}")
            time.sleep(_POLL_S)

    def _create(self, deadline: float) -> None:
        cmd = [self.redis_cli, "--cluster", "create", *[n.address for n in self.nodes],
               "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        if self.tls:
            cmd += ["--tls", "--cacert", str(self.ca_cert)]
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        if self.username:
            cmd += ["--user", self.username, "--pass", str(self.password), "--no-auth-warning"]
        elif self.password:
            env["REDISCLI_AUTH"] = self.password  # not on the command line
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise ClusterUnavailable(f"`redis-cli --cluster create` did not finish: {exc.stdout}") from exc
        if proc.returncode != 0 or "[OK] All 16384 slots covered" not in proc.stdout:
            raise ClusterUnavailable(
                f"`redis-cli --cluster create` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
            )

    def _client(self, node: Node) -> redis.Redis:
        """A cached plain client per node (admin commands only; replaced when the process is)."""
        cache = self._clients
        key = (node.port, node.proc.pid if node.proc else None)
        client = cache.get(key)
        if client is None:
            for stale in [k for k in cache if k[0] == node.port]:
                cache.pop(stale).close()
            client = cache[key] = self.node_client(node, socket_connect_timeout=1, socket_timeout=2)
        return client

    def _views(self, node: Node) -> list[NodeView]:
        raw = self._client(node).execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return [NodeView.parse(line) for line in text.splitlines() if line.strip()]

    def _own_view(self, node: Node) -> NodeView:
        return next(v for v in self._views(node) if "myself" in v.flags)

    def _cluster_state(self, node: Node) -> str:
        raw = self._client(node).execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        match = re.search(r"^cluster_state:(\w+)", text, re.M)
        return match.group(1) if match else "?"

    def _role(self, node: Node) -> str:
        role = self._client(node).execute_command("ROLE")[0]
        return role.decode() if isinstance(role, bytes) else str(role)

    def _slot_map(self, node: Node) -> dict[tuple[int, int], str]:
        return {rng: v.node_id for v in self._views(node) if "master" in v.flags for rng in v.slots}

    def _convergence_problem(self) -> str | None:
        """Why the cluster is not whole yet, or None when it is: every live node says
        ``cluster_state:ok``, sees every other live node connected and not failing, maps all 16384
        slots to live masters, the same map on every node; every live replica's link is up."""
        live = self.live_nodes()
        live_ids = {n.node_id for n in live}
        maps = []
        try:
            for node in live:
                state = self._cluster_state(node)
                if state != "ok":
                    return f"{node.address}: cluster_state {state}"
                views = {v.node_id: v for v in self._views(node)}
                for other in live:
                    view = views.get(other.node_id)
                    if view is None:
                        return f"{node.address} does not know {other.address} yet"
                    if view.failing or view.link_state != "connected":
                        return f"{node.address} sees {other.address} as {','.join(sorted(view.flags))} {view.link_state}"
                slot_map = self._slot_map(node)
                if sum(hi - lo + 1 for lo, hi in slot_map) != SLOTS:
                    return f"{node.address} maps {sum(hi - lo + 1 for lo, hi in slot_map)} slots"
                if not set(slot_map.values()) <= live_ids:
                    return f"{node.address} still maps slots to a dead node"
                maps.append(slot_map)
                if "slave" in views[node.node_id].flags:
                    link = self._client(node).info("replication").get("master_link_status")
                    if link != "up":
                        return f"replica {node.address}: master link {link}"
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            return f"a node does not answer: {exc}"
        if any(m != maps[0] for m in maps[1:]):
            return "the nodes do not agree on the slot map yet"
        return None

    def _failover_state(self, killed: _Killed) -> tuple[Node | None, str | None]:
        """(the promoted replica, None) once the cluster is whole again with the killed master's
        slots served by one of its former replicas, else (None, why not)."""
        problem = self._convergence_problem()
        if problem is not None:
            return None, problem
        slot_map = self._slot_map(self.live_nodes()[0])
        owners = {slot_map.get(rng) for rng in killed.slots}
        if len(owners) != 1 or not owners <= killed.replica_ids:
            return None, f"the slots of {killed.node.address} are not served by one of its replicas yet"
        return self.node_by_id(owners.pop()), None

    def _kill(self, node: Node) -> None:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
        if node.proc is not None:
            node.proc.wait(timeout=30)
            if node.proc.stderr:
                node.proc.stderr.close()
