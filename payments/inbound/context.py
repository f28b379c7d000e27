"""What callback processing needs of a process: its settings, engine, provider adapters and retry policy.

``payments.runtime.Runtime`` (the top floor, which builds them) is one; the
functions here take any object with these four, so this wing never imports
the floor above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from sqlalchemy import Engine

from payments.infra.backoff import RetryPolicy
from payments.infra.settings import Settings
from payments.providers.base import Provider


class Context(Protocol):
    """A process's settings and the objects derived from them (``payments.runtime.Runtime``)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def providers(self) -> Mapping[str, Provider]: ...

    @property
    def callback_policy(self) -> RetryPolicy: ...
