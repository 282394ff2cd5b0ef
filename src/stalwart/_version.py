"""The library's version, in a module of its own so that no module imports the package root for it."""

__version__ = "0.1.0"
