"""Fake payment platforms speaking real providers' protocols (outside parties: they import nothing of paysync)."""
