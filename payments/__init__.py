"""paysync's domain core, shared by every process.

It imports neither Flask, pika nor APScheduler: ``gateway/``, ``consumer/``
and ``compensator/`` are thin adapters around it.
"""
