"""Counting the hops a call path makes between paysync's own files (issue 22: "visits each file at most twice").

``trace(fn)`` runs ``fn`` under ``sys.setprofile`` and records every call one
of our files makes directly into another of our files, plus the first entry
into our code. Not hops: calls within one file, calls into the standard
library, SQLAlchemy or the tests, and calls those make back into our code
(SQLAlchemy's event hooks and type decorators run when SQLAlchemy decides, not
as a step of the path). A file's *visits* are the hops into it:
``relay_charge`` entering ``outbound_protocol.py``, then a call into
``breaker.py`` and back, is one visit to each.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
OURS = ("payments", "gateway", "consumer", "compensator", "broker")


class Hop(NamedTuple):
    """One call from a file of ours (None: the entry) into another, and the function called."""

    caller: str | None
    callee: str
    function: str


_cache: dict[str, str | None] = {}


def _ours(filename: str) -> str | None:
    if filename not in _cache:
        try:
            rel = Path(filename).resolve().relative_to(ROOT)
            _cache[filename] = str(rel) if rel.parts and rel.parts[0] in OURS else None
        except ValueError:
            _cache[filename] = None
    return _cache[filename]


def trace(fn: Callable[[], Any]) -> tuple[Any, list[Hop]]:
    """(fn's result, every hop it made, in order). Only the calling thread is traced."""
    hops: list[Hop] = []
    entered = [0]  # frames of ours on the stack

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "return"):
            return
        mine = _ours(frame.f_code.co_filename)
        if mine is None:
            return
        if event == "return":
            entered[0] -= 1
            return
        caller = _ours(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if entered[0] == 0:
            hops.append(Hop(None, mine, frame.f_code.co_name))
        elif caller is not None and caller != mine:
            hops.append(Hop(caller, mine, frame.f_code.co_name))
        entered[0] += 1

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, hops


def visits(hops: list[Hop]) -> Counter[str]:
    """How many times each file was entered."""
    return Counter(h.callee for h in hops)


def table(hops: list[Hop]) -> str:
    """The visits per file, most first, with the totals: for a report."""
    counted = visits(hops)
    lines = [f"{n:3d}  {path}" for path, n in counted.most_common()]
    revisits = len(hops) - len(counted)
    lines.append(f"{len(hops)} hops across {len(counted)} files, {revisits} back into a file already visited")
    return "\n".join(lines)


def made_by(hops: list[Hop], path: str) -> list[Hop]:
    """The entry and the hops ``path`` itself makes: the steps of a path written in that one file."""
    return [h for h in hops if h.caller in (None, path)]
