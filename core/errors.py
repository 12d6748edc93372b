"""A small exception hierarchy whose messages read as advice: what failed, why, what to change."""
from __future__ import annotations


class LeversError(Exception):
    """Base class for every error Levers raises on purpose."""


class ConfigError(LeversError, ValueError):
    """A config field has a value outside what it accepts."""

    def __init__(self, field: str, value, allowed: str, hint: str = ""):
        self.field, self.value, self.allowed = field, value, allowed
        msg = f"{field}={value!r} is not valid: expected {allowed}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


class BackendUnavailable(LeversError, RuntimeError):
    """An optional backend (bitsandbytes, torchao, fp8 compute, CUDA) is missing or broken here."""

    def __init__(self, backend: str, reason: str, install: str = ""):
        self.backend, self.reason, self.install = backend, reason, install
        msg = f"{backend} is not usable here: {reason}."
        if install:
            msg += f" Fix: {install}."
        super().__init__(msg)


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB (a budget of a few MiB would read "0.00 GiB")."""
    return f"{n / 1024 ** 3:.2f} GiB" if abs(n) >= 1024 ** 3 else f"{n / 1024 ** 2:.1f} MiB"


class BudgetExceeded(LeversError, RuntimeError):
    """A plan or operation needs more memory than the budget allows."""

    def __init__(self, needed_bytes: int, available_bytes: int, component: str, hint: str = ""):
        self.needed_bytes, self.available_bytes, self.component = needed_bytes, available_bytes, component
        msg = f"{component} needs {_size(needed_bytes)} but only {_size(available_bytes)} is available."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)


class IncompatibleInput(LeversError, TypeError):
    """A node or function got an object of the wrong kind (e.g. a CLIP wired into a MODEL input)."""

    def __init__(self, name: str, expected: str, got, hint: str = ""):
        self.name, self.expected = name, expected
        msg = f"{name}: expected {expected}, got {type(got).__name__}."
        if hint:
            msg += f" {hint}"
        super().__init__(msg)
