"""The WSGI entry point gunicorn loads: ``gateway.wsgi:app``."""

from gateway import create_app
from payments.settings import start_process

# gunicorn_conf.py already checked the settings and warned, once, in the master.
settings = start_process("web", warn=False)
app = create_app(settings)
