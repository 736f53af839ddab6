"""The package version, in one small module that imports nothing (persistence writes it into checkpoints)."""

__version__ = "0.1.0"
