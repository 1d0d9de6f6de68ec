"""Fixtures of the skills tests; the helpers are in skill_helpers.py."""

from tests.skills.skill_helpers import documents  # noqa: F401  (a fixture)
