"""The sandbox platform: its adapter and its settlement-file parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.
"""
