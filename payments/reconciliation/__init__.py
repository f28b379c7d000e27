"""Settlement files against our records: import, match, explain, and the ageing report.
It may import the kernel, infra, providers, money, escalation and lifecycle.
"""
