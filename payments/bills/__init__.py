"""Settlement-file (bill) parsers, one module per provider: pure streaming generators over the file's lines."""
