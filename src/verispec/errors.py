"""Errors a user can act on. The CLI prints their message on one line and exits non-zero."""


class VerispecError(Exception):
    """Base class: the message says what went wrong and what to do."""


class InvalidModelFile(VerispecError):
    """A model file is truncated, corrupt or inconsistent."""

    def __init__(self, path: object, problem: str):
        super().__init__(f"invalid model file {path}: {problem}")
        self.path = path
        self.problem = problem


class UnsupportedModel(VerispecError):
    """The file is valid but uses an architecture or tensor type verispec does not run."""


class ModelNotFound(VerispecError):
    """A model argument names no file, directory or built-in model."""


class ModelNotInstalled(VerispecError):
    """A built-in model's weight packages are missing or corrupt."""


class InvalidSetting(VerispecError):
    """An environment setting (VERISPEC_*) holds a value verispec does not take."""


class CacheWriteError(VerispecError, OSError):
    """A file could not be written: a full disk, a quota, a read-only or forbidden directory. An OSError
    too (with its errno), so callers that recompute when the cache is not writable still do."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequest(VerispecError):
    """Bad sampling parameters or prompt. `param` names the offending field and `code` is a
    machine-readable reason (the server reports both in the OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class NonFiniteOutput(VerispecError):
    """A model produced NaN or infinite scores: its weights or settings are broken (or overflow)."""
