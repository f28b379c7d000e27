"""A RabbitMQ vhost per xdist worker, so parallel workers never see each other's queues, exchanges or messages.

Made with ``rabbitmqctl`` when the broker is on this machine and the tool may
talk to it (root, or the rabbitmq user); otherwise the tests share the base
vhost, where every test already declares queues and exchanges of its own.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
import warnings

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _split(url: str) -> tuple[str, str, str]:
    """(prefix up to the host and port, user, vhost) of an amqp URL."""
    scheme, rest = url.split("://", 1)
    creds, _, hostpath = rest.rpartition("@")
    hostport, _, path = hostpath.partition("/")
    user = urllib.parse.unquote(creds.split(":", 1)[0]) if creds else "guest"
    vhost = urllib.parse.unquote(path) if path else "/"
    return f"{scheme}://{creds + '@' if creds else ''}{hostport}", user, vhost


def _host(url: str) -> str:
    hostport = url.split("://", 1)[1].rpartition("@")[2].split("/", 1)[0]
    return hostport.rsplit(":", 1)[0].strip("[]") if ":" in hostport else hostport


def _ctl(*args: str) -> bool:
    ctl = shutil.which("rabbitmqctl")
    if not ctl:
        return False
    done = subprocess.run([ctl, "-q", *args], capture_output=True, timeout=60, check=False)  # noqa: S603
    return done.returncode == 0


def worker_vhost_url(base_url: str, worker: str) -> str:
    """``base_url`` on a fresh vhost of ``worker``'s own, or ``base_url`` itself when none can be made here."""
    if not worker or _host(base_url) not in _LOCAL_HOSTS:
        return base_url
    prefix, user, vhost = _split(base_url)
    name = f"{'test' if vhost == '/' else vhost}_{worker}"
    _ctl("delete_vhost", name)  # a run that was killed may have left one behind, with its queues
    if not (_ctl("add_vhost", name) and _ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")):
        warnings.warn(f"could not make RabbitMQ vhost {name!r}; workers share {vhost!r}", stacklevel=2)
        return base_url
    return f"{prefix}/{urllib.parse.quote(name, safe='')}"


def delete_vhost(url: str) -> None:
    """Remove the vhost of ``url`` (and with it every queue the worker's tests left)."""
    _ctl("delete_vhost", _split(url)[2])
