"""Alipay: its adapter, RSA2 signing and certificate mode, and its bill parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.
"""
