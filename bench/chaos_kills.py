"""The seeded kill schedule: SIGKILL of processes every few seconds, one broker and one database restart.

Everything random comes from one ``random.Random(seed)``: which kind of
process is hit (a shuffled round of gateway worker, consumer, compensator, so
the kinds are hit equally often), which copy, the pauses, and the points of
the run (as a share of the payments answered) at which RabbitMQ and MariaDB
are SIGKILLed and started again. The schedule runs in one thread and does one
thing at a time, so a broker restart never overlaps a database restart.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from chaos_stack import Supervised, children

PROCESS_KINDS = ("gateway_worker", "consumer", "compensator")
"""The kinds of process the schedule SIGKILLs, one shuffled round of them at a time."""


class Server(Protocol):
    """A private server the schedule may kill and start again."""

    killable: bool
    kind: str

    def kill(self) -> None: ...  # noqa: D102

    def start(self) -> float: ...  # noqa: D102


@dataclass
class Kill:
    """One fault the schedule made."""

    at: float
    """Seconds since the start of the load."""
    kind: str
    """gateway_worker, consumer, compensator, rabbitmq or mariadb."""
    target: str
    pid: int | None = None
    down_seconds: float | None = None
    """Servers: from the SIGKILL until it answered again."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


@dataclass
class KillPlan:
    """The knobs of the schedule."""

    interval: float = 3.0
    """Mean seconds between process kills (each pause drawn from 0.5x-1.5x)."""
    kill_until: float = 0.6
    """Process kills stop once this share of the payments is answered ..."""
    process_kills: int = 0
    """... or, if > 0, exactly this many are made (however long that takes)."""
    broker_restart: bool = True
    database_restart: bool = True
    downtime: float = 2.0
    """Seconds a killed server stays down before it is started again."""


@dataclass
class KillSchedule:
    """Runs the plan against the stack while the load runs; ``kills`` is the record."""

    plan: KillPlan
    seed: int
    gateway: Supervised
    consumers: list[Supervised]
    compensators: list[Supervised]
    servers: dict[str, Server]
    progress: Callable[[], float]
    """Share of the payments answered so far, 0..1."""
    clock: Callable[[], float]
    """Seconds since the start of the load."""
    kills: list[Kill] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # Where in the run the servers go down: the broker in the first quarter, the database before the middle.
        self.server_points: list[tuple[float, str]] = []
        for kind, low, high, wanted in (
            ("rabbitmq", 0.12, 0.25, self.plan.broker_restart),
            ("mariadb", 0.30, 0.45, self.plan.database_restart),
        ):
            point = self.rng.uniform(low, high)
            server = self.servers.get(kind)
            if wanted and server is not None and server.killable:
                self.server_points.append((point, kind))
        self._round: list[str] = []
        self._tried: set[str] = set()
        """Process kinds a kill was attempted on (a gateway with no worker to kill counts: it was tried)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kill-schedule", daemon=True)

    def start(self) -> None:
        """Start the schedule thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop making faults (a restart in progress finishes first)."""
        self._stop.set()
        self._thread.join(300)

    @property
    def done(self) -> bool:
        """True once every planned fault was made."""
        return not self._thread.is_alive()

    def counts(self) -> dict[str, int]:
        """Faults made, by kind."""
        return dict(Counter(k.kind for k in self.kills))

    @property
    def last_fault_at(self) -> float | None:
        """When the last fault ended (a server's restart included), seconds since the start of the load."""
        if not self.kills:
            return None
        last = self.kills[-1]
        return last.at + (last.down_seconds or 0.0)

    def _process_kills_left(self) -> bool:
        made = sum(1 for k in self.kills if k.kind in PROCESS_KINDS)
        if self.plan.process_kills > 0:
            return made < self.plan.process_kills
        # A load that is over in a few seconds must still see each kind hit once (the "kills made" row):
        # past kill_until the schedule goes on until every kind was tried.
        return self.progress() < self.plan.kill_until or len(self._tried) < len(PROCESS_KINDS)

    def _run(self) -> None:
        next_kill = self.clock() + self._pause()
        while not self._stop.is_set():
            if self.server_points and self.progress() >= self.server_points[0][0]:
                _, kind = self.server_points.pop(0)
                self._restart_server(kind)
                next_kill = max(next_kill, self.clock() + self._pause() / 2)
                continue
            processes_left = self._process_kills_left()
            if not processes_left and not self.server_points:
                return
            if processes_left and self.clock() >= next_kill:
                self._kill_process()
                next_kill = self.clock() + self._pause()
            self._stop.wait(0.1)

    def _pause(self) -> float:
        return self.rng.uniform(0.5, 1.5) * self.plan.interval

    def _kill_process(self) -> None:
        if not self._round:
            self._round = list(PROCESS_KINDS)
            self.rng.shuffle(self._round)
        kind = self._round.pop()
        self._tried.add(kind)
        if kind == "gateway_worker":
            master = self.gateway.pid
            workers = children(master) if master else []
            if not workers:
                self.errors.append(f"{self.clock():.1f}s: no gateway worker to kill")
                return
            pid = self.rng.choice(workers)
            target = f"{self.gateway.label} worker"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pid = None
        else:
            group = self.consumers if kind == "consumer" else self.compensators
            proc = self.rng.choice(group)
            target = proc.label
            pid = proc.kill()
        self.kills.append(Kill(round(self.clock(), 2), kind, target, pid))

    def _restart_server(self, kind: str) -> None:
        server = self.servers[kind]
        at = self.clock()
        started = time.monotonic()
        server.kill()
        self._stop.wait(self.plan.downtime)
        try:
            server.start()
        except Exception as exc:  # the run cannot go on sensibly, but the table must still be printed
            self.errors.append(f"{kind} did not come back: {exc}")
        self.kills.append(Kill(round(at, 2), kind, kind, None, round(time.monotonic() - started, 2)))
