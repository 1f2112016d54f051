"""fl-secure: privacy-focused, secure federated training of face-recognition models."""

__version__ = "0.1.0"

__all__ = ["__version__"]
