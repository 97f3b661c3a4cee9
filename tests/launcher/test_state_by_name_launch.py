"""Optimizer state keyed by parameter name, loaded through ``backend.load_state_dict`` under the
real launchers, 2 processes each (the ``optstate`` section of each backend's core launch,
``tests/support/optstate_worker.py``): torch's own ``get_optimizer_state_dict`` form of a model
with a tied weight and two parameter groups, and parallelx's ``state.pt`` form, load as the
position-keyed state does, to the bit; what cannot load is a ParallelxError naming the key on
every rank.  ``single`` and ``dp`` run the same check in-process (tests/unit/test_state_by_name.py)."""

from __future__ import annotations

import pytest
from core_runs import core_cases, section_reports

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=core_cases())
def reports(request, tmp_path_factory):
    found = section_reports(request.param, "optstate", tmp_path_factory)
    assert [rep["world_size"] for rep in found] == [2, 2]
    return found


def test_name_keyed_state_loads_as_position_keyed(reports):
    for rep in reports:
        # torch keys the tied weight once, under its first name.
        assert rep["torch_keys"] == ["emb.weight", "mid.bias", "mid.weight", "norm.bias", "norm.weight"]
        assert rep["loaded_is_saved"]
        assert rep["loaded_equal"] == {"position": True, "torch": True, "parallelx": True}
        assert rep["after_equal"] == {"position": True, "torch": True, "parallelx": True}
        assert rep["continues_run"]


def test_what_cannot_load_is_refused_naming_the_key(reports):
    for rep in reports:
        refused = rep["refused"]
        assert "'emb.wieght'" in refused["name"] and "close: 'emb.weight'" in refused["name"]
        assert "'exp_avg' of 'mid.weight' has shape (6, 7)" in refused["shape"]
        assert "1 parameter group(s)" in refused["groups"] and "['mid.weight']" in refused["groups"]
