"""A charge through ``relay_charge`` reads as one module: the protocol's steps, each file visited at most twice.

Issue 22 found a charge hopping 32 times across 15 files, mostly between
relay.py and calls.py. The prepare → call → apply sequence now lives in
``payments.outbound.protocol``; this traces one real charge (SQLite, a fake
provider at the network edge) with ``tests.hops`` and holds the counts.
"""

from __future__ import annotations

from dataclasses import replace

from payments.infra.db import utcnow
from payments.outbound import protocol as outbound_protocol
from payments.outbound.protocol import Context, Result, relay_charge
from payments.providers.base import Capabilities, Dedupe
from payments.runtime import build_runtime
from tests.fake_provider import FakeProvider
from tests.hops import made_by, table, trace, visits
from tests.outbound_support import new_payment
from tests.support import make_settings

PROTOCOL = "payments/outbound/protocol.py"


def _traced_charge(engine):
    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False))
    rt = build_runtime(settings, engine)
    fake = FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True))
    rt = replace(rt, providers={**rt.providers, fake.name: fake})
    ctx = Context(rt.engine, rt.providers, rt.settings)
    new_payment(rt, provider="fake")
    [(outbox_id, provider, lease, _)] = outbound_protocol.claim_sends(rt.engine, utcnow(), 10, 30)
    return trace(lambda: relay_charge(ctx, outbox_id, provider, lease))


def test_a_charge_enters_the_protocol_once_and_each_file_it_calls_at_most_twice(sqlite):
    result, hops = _traced_charge(sqlite)

    assert result == Result.APPLIED
    steps = made_by(hops, PROTOCOL)
    assert visits(hops)[PROTOCOL] == 1, "the protocol is never re-entered from another file:\n" + table(hops)
    over = {path: n for path, n in visits(steps).items() if n > 2}
    assert not over, "the protocol's steps visit these files more than twice:\n" + table(steps)


def test_the_whole_charge_path_stays_within_its_measured_hops(sqlite):
    """25 hops across 14 files when measured (issue 22's review counted 32 across 15 before): it may only shrink."""
    _, hops = _traced_charge(sqlite)

    assert len(hops) <= 25, table(hops)
    assert max(visits(hops).values()) <= 4, table(hops)  # states.py: a decide and a transition per step
