"""The sandbox payment platform: a real HTTP service that behaves like a payment provider.

``python -m sandbox`` (the Procfile's ``sandbox`` line) serves it. Modules:
``app`` (Flask routes), ``store`` (SQLite state, one transaction per unit of
work), ``webhooks`` (the delivery thread), ``faults`` (knobs and seeded dice),
``settlement`` (the CSV builder), ``model`` (validation and JSON shapes), and
``signing``, the one place that knows how its notifications are signed; the
platform, paysync's adapter, the tests and the benchmarks all use it.
"""
