"""Settlement-file (bill) parsers, one module per provider: pure streaming generators."""
