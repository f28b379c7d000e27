"""Notifications from the providers: store, verify, apply (callbacks), the signed message that
carries one through the broker and the batch that applies many (delivery), and unverified hints.
It may import every wing below it: the kernel, infra, providers, money, escalation and lifecycle.
"""
