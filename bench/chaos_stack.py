"""The chaos run's private stack: its own MariaDB and RabbitMQ, and every paysync process under a restart loop.

Everything lives under one temporary directory: data directories, sockets,
logs. Each server is started in a session of its own (``start_new_session``),
so a SIGKILL of its process group reaches that server and its helpers only:
the machine's own MariaDB (3306) and RabbitMQ node (5672/25672) are never
touched. epmd is shared by every Erlang node on a host; ours registers with it
and leaves it running.

``ExternalServer`` stands for a server named by ``--database-url`` or
``--amqp-url``: it is used, never killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, procfile_command  # the bench directory is on sys.path when run as a script


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections on ``port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> float:
    """Poll ``predicate`` until true; return the seconds it took, or raise TimeoutError naming ``what``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s")


def kill_group(popen: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group of ``popen`` (its own session), then reap it."""
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass
    try:
        popen.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(10)


class ExternalServer:
    """A database or broker this run did not start: used as it is, never killed."""

    killable = False

    def __init__(self, url: str, kind: str) -> None:
        self.url = url
        self.kind = kind

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop: it is not ours."""


class PrivateMariaDB:
    """A mariadbd of our own: its own datadir, port and socket under ``base``; root without a password on TCP."""

    killable = True
    kind = "mariadb"

    def __init__(self, base: Path, database: str = "paysync_chaos") -> None:
        self.base = base / "mariadb"
        self.port = free_port()
        self.database = database
        self.popen: subprocess.Popen | None = None
        self.log_path = self.base / "mariadbd.log"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the chaos database on this server."""
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{self.database}"

    def start(self) -> float:
        """Create the data directory the first time, start mariadbd, create the database; seconds until ready."""
        datadir = self.base / "data"
        # A tmpdir of its own, for the install's bootstrap server too: at every start mariadbd deletes the #sql*
        # files it finds in its tmpdir (mysql_rm_tmp_tables), and with the default /tmp those were the live
        # temporary tables of the machine's own MariaDB. A make test worker lost its connection that way (error 6,
        # "Error on delete of '/tmp/#sql-temptable-....MAI'", on every test after it).
        tmpdir = self.base / "tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        if not datadir.exists():
            datadir.mkdir(parents=True)
            subprocess.run(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={datadir}",
                    f"--tmpdir={tmpdir}",
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
        started = time.monotonic()
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it; closed with the process
        self.popen = subprocess.Popen(
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={datadir}",
                f"--tmpdir={tmpdir}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--socket={self.base / 'mariadbd.sock'}",
                f"--pid-file={self.base / 'mariadbd.pid'}",
                "--user=root",
                "--skip-log-bin",
                "--skip-name-resolve",
                "--max-connections=500",
                "--innodb-buffer-pool-size=256M",
                f"--log-error={self.log_path}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._answers, 120, "private MariaDB")
        return time.monotonic() - started

    def _answers(self) -> bool:
        import pymysql

        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"mariadbd exited with {self.popen.returncode}; see {self.log_path}")
        try:
            conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2)
        except pymysql.MySQLError:
            return False
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{self.database}` CHARACTER SET utf8mb4")
            return True
        finally:
            conn.close()

    def kill(self) -> None:
        """SIGKILL the server (InnoDB recovers on the next start)."""
        if self.popen is not None:
            kill_group(self.popen)
            self.popen = None

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it takes too long."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                kill_group(self.popen)
            self.popen = None


class PrivateRabbitMQ:
    """A RabbitMQ node of our own: node name, AMQP and distribution ports, Erlang cookie, data and logs under ``base``.

    Started from ``/usr/lib/rabbitmq/bin/rabbitmq-server`` (Debian's
    ``/usr/sbin`` wrapper would switch to the ``rabbitmq`` user and the
    system's files). ``RABBITMQ_CONF_ENV_FILE`` points at an empty file of
    ours so the machine's ``rabbitmq-env.conf`` (node name ``rabbit@localhost``)
    is not read; no plugins, so no management listener to collide with.
    """

    killable = True
    kind = "rabbitmq"
    SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"

    def __init__(self, base: Path) -> None:
        self.base = base / "rabbitmq"
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"paysync-chaos-{os.getpid()}@localhost"
        self.popen: subprocess.Popen | None = None
        self.log_path = self.base / "rabbitmq-server.log"

    @property
    def url(self) -> str:
        """AMQP URL of the default vhost (guest is allowed from loopback)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def _env(self) -> dict[str, str]:
        b = self.base
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            {
                "HOME": str(b / "home"),  # the Erlang cookie is $HOME/.erlang.cookie: ours, not the system's
                "RABBITMQ_CONF_ENV_FILE": str(b / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_CONFIG_FILE": str(b / "rabbitmq.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(b / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(b / "mnesia"),
                "RABBITMQ_LOG_BASE": str(b / "log"),
                "RABBITMQ_PID_FILE": str(b / "rabbitmq.pid"),
                "ERL_EPMD_ADDRESS": "127.0.0.1",
            }
        )
        return env

    def start(self) -> float:
        """Write the node's files the first time, start it, wait for an AMQP handshake; seconds until ready."""
        if not Path(self.SERVER).exists():
            raise RuntimeError(f"{self.SERVER} not found: install rabbitmq-server (apt-get install -y rabbitmq-server)")
        b = self.base
        if not b.exists():
            for sub in ("home", "mnesia", "log"):
                (b / sub).mkdir(parents=True)
            (b / "rabbitmq-env.conf").write_text("")
            (b / "enabled_plugins").write_text("[].\n")
            (b / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
                "loopback_users.guest = true\n"
                "log.console = false\n"
                "log.file.level = warning\n"
                # A 2-core machine under load: do not refuse publishers for disk or memory alarms.
                "disk_free_limit.absolute = 50MB\n"
                "vm_memory_high_watermark.relative = 0.8\n"
            )
        started = time.monotonic()
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        self.popen = subprocess.Popen(
            [self.SERVER],
            cwd=b,
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._answers, 180, "private RabbitMQ", interval=0.5)
        return time.monotonic() - started

    def _answers(self) -> bool:
        import pika
        import pika.exceptions

        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited with {self.popen.returncode}; see {self.log_path}")
        if not port_open(self.port):
            return False
        try:
            params = pika.URLParameters(self.url)
            params.socket_timeout = 2
            params.connection_attempts = 1
            pika.BlockingConnection(params).close()
            return True
        except (pika.exceptions.AMQPError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL the node (its shell, beam.smp and helpers: all in its session)."""
        if self.popen is not None:
            kill_group(self.popen)
            self.popen = None

    def stop(self) -> None:
        """SIGTERM (the script stops the node cleanly), SIGKILL if it takes too long."""
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                kill_group(self.popen)
            self.popen = None


@dataclass
class Supervised:
    """One Procfile process under a restart loop, as systemd or supervisord would run it.

    The loop restarts the process whenever it exits (killed, crashed, or
    refused to start because the database was down), after a short pause that
    grows while it keeps dying young.
    """

    label: str
    procfile_name: str
    env: dict[str, str]
    log_dir: Path
    popen: subprocess.Popen | None = None
    command: list[str] | None = None
    """What to run instead of the Procfile line (a fake platform has none)."""
    starts: int = 0
    stopping: bool = False
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def log_path(self) -> Path:
        """Everything the process printed, across restarts."""
        return self.log_dir / f"{self.label}.log"

    def start(self) -> None:
        """Start the process and its restart loop."""
        self._spawn()
        self._thread = threading.Thread(target=self._loop, name=f"supervise-{self.label}", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        with self._lock:
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
            self.popen = subprocess.Popen(
                self.command or procfile_command(self.procfile_name),
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            self.starts += 1

    def _loop(self) -> None:
        pause = 0.5
        while not self.stopping:
            popen = self.popen
            started = time.monotonic()
            popen.wait()
            if self.stopping:
                return
            pause = min(pause * 2, 5.0) if time.monotonic() - started < 5 else 0.5
            time.sleep(pause)
            if not self.stopping:
                self._spawn()

    @property
    def pid(self) -> int | None:
        """The current process id (None between a death and the restart)."""
        popen = self.popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def kill(self) -> int | None:
        """SIGKILL the current process (the loop restarts it); return the pid killed."""
        pid = self.pid
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
        return pid

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the loop and the process (SIGTERM to its group, SIGKILL if it lingers)."""
        self.stopping = True
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            kill_group(popen)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (gunicorn workers of their master), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def remove_tree(path: Path) -> None:
    """Delete the run's temporary directory (best effort)."""
    shutil.rmtree(path, ignore_errors=True)
