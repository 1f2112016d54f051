"""Error hierarchy of fl-secure.

Every error says *what* is wrong and, where it can, *what to do* about it.
"""

from __future__ import annotations

#: What reading an untrusted JSON document into typed fields can raise: malformed JSON or hex
#: (ValueError), missing keys, wrong types, ``int(Infinity)`` (OverflowError), nesting beyond
#: the parser's limit (RecursionError). Readers turn each into their own error naming the
#: document.
JSON_DOCUMENT_ERRORS = (
    ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
)  # fmt: skip


class FlSecureError(Exception):
    """Base class of every error raised on purpose by fl-secure."""


class ConfigError(FlSecureError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class DataError(FlSecureError, ValueError):
    """A data set on disk is missing, malformed or too small for the request."""


class ProtocolError(FlSecureError, ValueError):
    """A network message violates the wire contract (digest, shape, dtype, size, values)."""


class CheckpointError(FlSecureError):
    """A checkpoint or run directory cannot be read or written safely."""


class TlsError(FlSecureError):
    """Certificates or keys are missing, invalid or do not match."""


class RoundAborted(FlSecureError):
    """A round could not complete (too few clients) and was aborted without an update."""


class PrivacyError(FlSecureError, ValueError):
    """A privacy-accounting request is out of range, unsupported or cannot be met."""


class UpdateError(PrivacyError):
    """A client's own update cannot be released: it is not finite or has the wrong size."""
