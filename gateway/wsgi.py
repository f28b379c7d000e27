"""The WSGI entry point gunicorn loads: ``gateway.wsgi:app``.

The gateway starts like every other process (``payments.runtime.start_process``):
a bad setting is one line on stderr and exit code 2, logging is set up,
failpoints are armed, the engine and adapters are built. Under the Procfile's
``web`` line gunicorn's master has already checked the settings
(``gateway/gunicorn_conf.py``), so a worker never gets this far with a bad one.
"""

from gateway import create_app
from payments.runtime import start_process

app = create_app(runtime=start_process("web"))
