"""The toolkit's version (a module of its own so that any package can read it without the public API)."""

__version__ = "0.1.0"
