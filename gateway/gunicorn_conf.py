"""gunicorn settings for the gateway, taken from paysync's settings.

gunicorn reads this file in its master before any worker starts, so a bad
setting stops ``web`` here: one line naming the variable on stderr and exit
code 2, like every other process (gunicorn reports an exception in its config
file with a traceback and exit 1; SystemExit passes through it).
"""

from payments.runtime import settings_or_exit

_settings = settings_or_exit("web")

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
