"""The chaos run's kill schedule (bench/chaos_kills.py) with stand-in processes: nothing is really killed."""

from __future__ import annotations

import sys
import time

from tests.support import ROOT

sys.path.append(str(ROOT / "bench"))

from chaos_kills import KillPlan, KillSchedule  # noqa: E402


class StandIn:
    """Takes the place of a Supervised process: ``kill`` only counts."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.pid = None  # a gateway without workers: nothing to kill there
        self.killed = 0

    def kill(self) -> int:
        self.killed += 1
        return 4242


def schedule(progress: float, **plan) -> KillSchedule:  # noqa: ANN003
    plan = {"interval": 0.01, "broker_restart": False, "database_restart": False, **plan}
    return KillSchedule(
        KillPlan(**plan),
        seed=3,
        gateway=StandIn("web"),
        consumers=[StandIn("consumer-1")],
        compensators=[StandIn("compensator-1")],
        servers={},
        progress=lambda: progress,
        clock=time.monotonic,
    )


def run(s: KillSchedule) -> KillSchedule:
    s.start()
    deadline = time.monotonic() + 10
    while not s.done and time.monotonic() < deadline:
        time.sleep(0.01)
    s.stop()
    return s


def test_a_load_over_before_the_first_kill_still_sees_each_kind_of_process_tried_once():
    s = run(schedule(progress=1.0))  # every payment answered already: past kill_until from the start
    assert s.done
    assert s.counts() == {"consumer": 1, "compensator": 1}
    assert any("no gateway worker" in e for e in s.errors), "the gateway was tried too"


def test_an_exact_number_of_process_kills_is_made_as_asked():
    s = run(schedule(progress=1.0, process_kills=5))
    assert sum(s.counts().values()) == 5  # a try on a gateway with no worker is not a kill
