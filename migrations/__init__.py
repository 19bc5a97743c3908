"""Alembic migrations of the plan store (a package so that it ships in the wheel).

``planner.store.schema`` finds this directory and drives Alembic from code; from a checkout,
``alembic upgrade head`` with the repository's ``alembic.ini`` works as well.
"""
