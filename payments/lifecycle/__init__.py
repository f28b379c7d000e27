"""How a payment's or refund's state changes, and who hears of it: the guarded transitions,
the outbox of calls to make, and the merchant's events. It may import the kernel, ``payments.infra``,
``payments.providers``, ``payments.money`` and ``payments.escalation``.
"""
