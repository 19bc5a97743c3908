"""The CLI, the API and the search read the optimizer registry (planner.optim), not a list of their own."""

from __future__ import annotations

from planner.optim import OPTIMIZERS, SEARCHED, Optimizer, names


def test_the_help_and_the_api_list_the_registry():
    import typer.main

    from planner.cli import get_app
    from planner.service.schemas import EstimateBody

    estimate = typer.main.get_command(get_app()).commands["estimate"]
    assert next(p for p in estimate.params if p.name == "optimizer").help == names()
    assert EstimateBody.model_fields["optimizer"].description == names()


def test_the_search_and_the_ranking_read_the_descriptors():
    from planner.config import TrainConfig
    from planner.ranking import OPTIMIZER_PREFERENCE
    from planner.search import SearchSpace
    from planner.tradeoffs import _optimizer_note

    assert SearchSpace().optimizers == SEARCHED
    assert OPTIMIZER_PREFERENCE == {o: OPTIMIZERS[o].preference for o in Optimizer}
    for o in Optimizer:
        note = OPTIMIZERS[o].note
        assert _optimizer_note(TrainConfig(optimizer=o)) == ([note] if note else [])
