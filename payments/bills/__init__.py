"""Settlement-file (bill) parsers, one module per provider: pure streaming generators over the file's lines.

Each provider's lines are mapped onto ``payments.settlement.SettlementLine`` by its parser entry in
``payments.reconcile.PARSERS``.
"""
