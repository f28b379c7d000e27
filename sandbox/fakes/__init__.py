"""Fake payment platforms, one module per real provider: outside parties that import nothing of paysync."""
