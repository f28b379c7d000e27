"""The log scrubber: the second line of defence for invariant 9."""

from __future__ import annotations

import json
import logging

from payments.logs import JsonFormatter, luhn_valid, scrub


def test_card_numbers_are_redacted_however_they_are_written():
    for text in ["4111111111111111", "pay_4111111111111111", "4111 1111 1111 1111", "5500-0000-0000-0004"]:
        scrubbed = scrub(f"card {text} seen")
        assert "[REDACTED-PAN]" in scrubbed, text
        assert text not in scrubbed


def test_long_numbers_that_are_not_card_numbers_stay_readable():
    assert scrub("created 1764487000000 ms") == "created 1764487000000 ms"
    assert not luhn_valid("1764487000000")


def test_secrets_signatures_and_bearer_tokens_are_redacted():
    text = scrub('secret=whsec_abc token: "tok_1" Sandbox-Signature t=1,v1=' + "ab" * 32 + " Bearer xyz123")
    assert "whsec_abc" not in text and "tok_1" not in text and "ab" * 32 not in text and "xyz123" not in text


def test_the_formatter_scrubs_messages_and_extras():
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "paid with %s", ("4111111111111111",), None)
    record.body = {"cvv": "123", "pan": "4012888888881881"}
    line = JsonFormatter().format(record)
    assert "4111111111111111" not in line and "4012888888881881" not in line
    assert json.loads(line)["msg"] == "paid with [REDACTED-PAN]"
