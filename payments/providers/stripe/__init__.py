"""Stripe: its adapter, webhook signatures, minor-unit money and its balance-report
parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.
"""
