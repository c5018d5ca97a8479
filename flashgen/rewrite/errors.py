"""The matcher's internal signal: a candidate that is not (rewritable) attention."""
from __future__ import annotations


class Reject(Exception):
    """Raised anywhere inside a match; AttentionPattern.match turns it into a Rejection."""

    def __init__(self, reason: str, **details):
        super().__init__(reason)
        self.reason = reason
        self.details = details
