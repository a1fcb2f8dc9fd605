"""What the integration tests share: each is marked `integration`; the TRL tests
(test_trl*.py) are collected only where TRL and its data stack are installed (TRL 1.16
needs Python >= 3.11), so their modules import them plainly."""

import importlib.util

import pytest

_TRL_STACK = ("transformers", "trl", "datasets", "tokenizers")
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in _TRL_STACK) \
    else ["test_trl*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/integrations/" in item.nodeid:
            item.add_marker(pytest.mark.integration)
