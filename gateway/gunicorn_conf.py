"""gunicorn settings for the gateway, taken from paysync's settings."""

from payments.settings import load_settings

_settings = load_settings()

bind = f"0.0.0.0:{_settings.port}"
workers = _settings.web_workers
worker_class = "sync"
timeout = 30
graceful_timeout = 20
keepalive = 5
accesslog = None  # the gateway logs what matters; a line per request costs throughput
# gunicorn's control socket has one default path per user; several gateways on one host (tests,
# benchmarks, blue/green) would fight over it, and nothing here uses it.
control_socket_disable = True
