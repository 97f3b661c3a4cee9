"""The unit tier runs in this process only: a test that starts a subprocess belongs in tests/system/."""

import pytest
from inprocess import forbid_subprocesses

no_subprocess = pytest.fixture(autouse=True)(forbid_subprocesses)
