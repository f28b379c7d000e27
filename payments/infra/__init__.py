"""What every capability stands on and that decides nothing about money: the database (engine,
schema, migrations, group commit, locks, cursors), settings (parsing values only), logs, metrics, ids,
back-off, rate limiting, network source checks, webhook signing, failpoints and callback-row retention.
It may import the kernel (``payments.errors``, ``payments.states``) and nothing else of payments.
"""
