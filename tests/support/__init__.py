"""Shared pieces of the tests (a real service, hand-made plans and databases, a Ray head)."""
