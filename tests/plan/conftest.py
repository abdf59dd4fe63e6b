"""Every planner test plans on this machine's CPU, whether or not a GPU is visible (see planner_on_this_cpu)."""

import pytest


@pytest.fixture(autouse=True)
def _planner_on_this_cpu(planner_on_this_cpu: None) -> None:
    """Applies the shared fixture to every test here."""
