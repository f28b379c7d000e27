"""The WSGI entry point gunicorn loads: ``gateway.wsgi:app``.

The gateway starts like every other process (``payments.runtime.start_process``
then ``payments.runtime.build_runtime``): a bad setting is one line on stderr
and exit code 2, logging is set up, failpoints are armed, the engine and
adapters are built. Under the Procfile's ``web`` line gunicorn's master has
already checked the settings (``gateway/gunicorn_conf.py``), so a worker never
gets this far with a bad one.
"""

from gateway import create_app
from payments.runtime import build_runtime, start_process

# gunicorn_conf.py already checked the settings and warned, once, in the master.
_settings = start_process("web", warn=False)
# One connection per request thread (gthread), so a busy worker's threads never queue for the pool; with inline
# processing one more per inline thread (as many), kept open too: an overflow connection is closed when handed back,
# and a worker whose request and inline threads were all busy opened and closed one per callback. At most twice
# WEB_THREADS either way, as before.
_kept = _settings.web_threads * (2 if _settings.process_inline else 1)
app = create_app(runtime=build_runtime(_settings, pool_size=_kept, max_overflow=2 * _settings.web_threads - _kept))
