"""Settlement (bill) file parsers, one module per provider format; the interface is ``payments.settlement``."""
