"""The sandbox payment platform: a real HTTP service that behaves like a payment provider.

It is an outside party: it imports nothing of paysync, and paysync imports
nothing of it (paysync's ``payments/providers/sandbox/adapter.py`` speaks its HTTP
protocol and implements its signature scheme on its own, as it would for any
provider). ``python -m sandbox`` (the Procfile's ``sandbox`` line) serves it.
Modules: ``config`` (its own settings), ``app`` (Flask routes), ``store``
(SQLite state, one transaction per unit of work), ``webhooks`` (the delivery
thread), ``faults`` (knobs and seeded dice), ``settlement`` (the CSV builder),
``model`` (validation and JSON shapes), ``signing`` (how its notifications are
signed), ``ids`` and ``logs``.
"""
