"""The argument tests' fixtures."""

import pytest


@pytest.fixture
def cuda_host(monkeypatch):
    """Validate as on a host where CUDA is usable (test_attention.py tests the device check itself)."""
    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)
