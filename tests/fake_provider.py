"""A scripted payment provider at the network edge, for the relay's and the query job's decisions.

It declares whatever capabilities a test gives it, answers charges and
queries from scripts (an outcome, an exception to raise, or a callable), and
records every call, so a test can say exactly how often we called it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from payments.providers.base import Capabilities, ChargeRequest, NotFound, Provider, Succeeded

Answer = Any  # an outcome, an exception to raise, or a callable returning one


class FakeProvider(Provider):
    """Answers from the scripts given; when a script runs out, ``charge`` succeeds and ``query`` finds nothing."""

    callback_headers = ()

    def __init__(
        self,
        capabilities: Capabilities,
        *,
        name: str = "fake",
        charges: list[Answer] | None = None,
        queries: list[Answer] | None = None,
        on_charge: Callable[[ChargeRequest, str | None], None] | None = None,
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self.charge_script = list(charges or [])
        self.query_script = list(queries or [])
        self.on_charge = on_charge
        self.charges: list[tuple[ChargeRequest, str | None]] = []
        self.queries: list[str] = []
        self._lock = threading.Lock()

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float):
        with self._lock:
            self.charges.append((payment, idempotency_key))
            answer = self.charge_script.pop(0) if self.charge_script else Succeeded(f"ch_{payment.payment_id}")
        if self.on_charge:
            self.on_charge(payment, idempotency_key)
        return _give(answer)

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None):
        with self._lock:
            self.queries.append(payment_id)
            answer = self.query_script.pop(0) if self.query_script else NotFound()
        return _give(answer)


def _give(answer: Answer):
    if isinstance(answer, BaseException):
        raise answer
    return answer() if callable(answer) else answer
