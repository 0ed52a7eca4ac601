import os
import sys

# tests/models.py holds the small models shared by the backend tests.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def fresh_dynamo():
    """Compile from scratch: each test sees its own graphs (and the next test none of them)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
