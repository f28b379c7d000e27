"""What a person is told and asked: alerts, the alert rules file and its evaluators,
notifications and their channels (``notify/``), and the manual-review queue. It may import the kernel and
``payments.infra``; every other wing may raise an alert or open a review through it.
"""
