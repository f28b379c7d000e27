"""Notifications from the providers: store, verify, apply (callbacks), the signed message that
carries one through the broker and the batch that applies many (delivery), unverified hints, the
consumer's and the sweep's processing, re-verification and the catch-up of events a provider lists.
It may import every wing below it: the kernel, infra, providers, money, escalation and lifecycle.
"""
