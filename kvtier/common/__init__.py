"""Helpers every layer may use (byte sizes, typed option parsing, plugin loading, CPU threads).
A leaf package: it imports nothing else from kvtier."""
