"""Sandbox events that are JSON but not events: refused as malformed, never an error of ours."""

from __future__ import annotations

import pytest

from payments.errors import MalformedCallback
from payments.providers.sandbox.adapter import parse_event
from tests.support import sandbox_event


@pytest.mark.parametrize("event_type", [[], {}, ["charge.succeeded"], {"charge.succeeded": 1}, 1, None, True])
def test_an_event_type_that_is_not_a_string_is_malformed(event_type):
    # Found by tests/test_fuzz_http.py: a signed body with "type": [] was a TypeError and a 500.
    event = sandbox_event("pay_1") | {"type": event_type}
    with pytest.raises(MalformedCallback, match="unknown event type"):
        parse_event("sandbox", event)


def test_a_known_event_type_still_parses():
    assert parse_event("sandbox", sandbox_event("pay_1")).merchant_reference == "pay_1"
