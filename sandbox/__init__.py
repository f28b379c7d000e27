"""The sandbox payment platform: a real HTTP service that behaves like a payment provider.

``sandbox.signing`` is the one place that knows how its notifications are
signed; the platform, paysync's adapter, the tests and the benchmarks all use it.
"""
