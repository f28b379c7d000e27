"""The ops console through the Flask test client: an app on a test database, its CSRF token, a login."""

from __future__ import annotations

import re

from gateway import create_app
from tests.support import make_settings

OPS = "dev-ops-token"
"""The development OPS_TOKEN of the test settings (role operator)."""


def console_app(engine, **overrides):  # noqa: ANN001, ANN201
    """The gateway app on ``engine`` with the test settings plus ``overrides``."""
    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False), **overrides)
    return create_app(settings, engine=engine)


def csrf(page: str) -> str:
    """The CSRF token a console page's forms carry."""
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def login(client, token: str = OPS, name: str = "alice"):  # noqa: ANN001, ANN201
    """Log ``client`` in as ``name``."""
    page = client.get("/ops/login")
    return client.post("/ops/login", data={"csrf": csrf(page.text), "name": name, "token": token})


def flashes(page: str) -> list[tuple[str, str]]:
    """The (category, text) of each flash message on a page."""
    return re.findall(r'<div class="flash (\w+)">(.*?)</div>', page, flags=re.S)
