"""Exceptions users see. The CLI prints them as one line (exit 1; UsageError: 2)."""


class FlashgenError(RuntimeError):
    """A flashgen operation failed; the message says what and why."""


class UsageError(FlashgenError, ValueError):
    """The user asked for something invalid (bad flag, unsupported spec, bad input file)."""


class BuildError(FlashgenError):
    """A build could not run or a compiler failed; the message carries the compiler's own."""


class LoadError(FlashgenError):
    """A library, manifest or module file could not be loaded."""
