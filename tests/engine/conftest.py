"""Fixtures shared by the engine tests."""

from tests.forcing import force_auto_flags  # noqa: F401  (a fixture of the tests here)
