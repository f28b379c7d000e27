"""WeChat Pay v3: its adapter, signing and platform keys, and its bill parser.
It may import the kernel, ``payments.infra`` and ``payments.providers.base``/``settlement``.
"""
