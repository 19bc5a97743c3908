"""A Ray address from the environment (``RAY_ADDRESS``, which ``ray.init()`` reads and a Ray job's driver has set)
is checked like ``--ray-address``, and its one-line error names where the value came from and how to fix it there
(set or unset the variable, or give the option): a user who never typed ``--ray-address`` is not told about it as
if they had. The check comes before anything is planned or stored, as the option's does."""

from __future__ import annotations

import json

import pytest
from support.ray import tiny_config  # noqa: F401

from planner.errors import InvalidConfigError


def _plans(cli):
    return json.loads(cli("history", "--json", "-n", "100").out)


@pytest.mark.parametrize("address, what", [("nonsense", "is not a Ray address"),
                                           ("http://127.0.0.1:8265", "is a dashboard (job API) address")])
def test_a_malformed_ray_address_in_the_environment_is_named_as_the_environment_s(cli, tiny_config, monkeypatch,  # noqa: F811
                                                                                 address, what):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", address)
    r = cli("suggest", "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64", "--verify")
    assert r.code == 2, r
    assert len(r.err.strip().splitlines()) == 1 and r.out == "", r
    assert f"the environment variable RAY_ADDRESS={address!r} {what}" in r.err, r
    assert "unset RAY_ADDRESS" in r.err and "--ray-address '" not in r.err, r
    assert _plans(cli) == []  # refused before the plan was stored


def test_the_option_wins_over_the_environment_and_keeps_its_own_wording(monkeypatch):
    from planner.verify.cluster import check_joined

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(InvalidConfigError, match=r"^--ray-address 'nonsense' is not a Ray address: give auto"):
        check_joined("nonsense")
    assert check_joined(None) == "auto"  # the variable's, well formed: nothing to reach before ray.init
    monkeypatch.delenv("RAY_ADDRESS")
    assert check_joined(None) is None  # neither: Ray starts embedded
