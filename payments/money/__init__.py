"""The ledger: append-only entries for every movement of money, and their sealing.
It may import the kernel and ``payments.infra``.
"""
