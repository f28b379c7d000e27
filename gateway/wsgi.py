"""The WSGI entry point gunicorn loads: ``gateway.wsgi:app``."""

from gateway import create_app
from payments.logs import setup_logging
from payments.settings import load_settings

settings = load_settings()
setup_logging(settings.log_level, "web")
app = create_app(settings)
