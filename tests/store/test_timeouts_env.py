"""The database deadlines read from the environment: a bad value is one line naming its variable."""

from __future__ import annotations

import pytest

from planner.store.deadlines import from_env


@pytest.mark.parametrize("variable, value", [
    ("PLANNER_DB_CONNECT_TIMEOUT", "inf"), ("PLANNER_DB_STATEMENT_TIMEOUT", "-3"),
    ("PLANNER_DB_POOL_TIMEOUT", "nan"), ("PLANNER_DB_POOL_TIMEOUT", "0"),
])
def test_a_deadline_out_of_range_names_its_variable_and_the_fix(variable, value):
    # said "PLANNER_DB_CONNECT_TIMEOUT / PLANNER_DB_STATEMENT_TIMEOUT / PLANNER_DB_POOL_TIMEOUT:
    # connect_s must be ...": three variables and a field name no user sets
    with pytest.raises(ValueError) as raised:
        from_env({variable: value})
    line = str(raised.value)
    assert line.startswith(f"{variable} must be") and "unset it" in line and "_s " not in line, line


def test_good_deadlines_are_read():
    timeouts = from_env({"PLANNER_DB_CONNECT_TIMEOUT": "2", "PLANNER_DB_POOL_TIMEOUT": " 30 "})
    assert (timeouts.connect_s, timeouts.pool_s, timeouts.statement_s) == (2.0, 30.0, 10.0)
