"""Shared fixtures: tiny random Hugging Face checkpoints per family, made once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import FAMILY_CONFIGS, make_hf_model  # noqa: E402

_MADE: dict = {}


@pytest.fixture(scope="session")
def hf_family(tmp_path_factory):
    """family name -> (directory, torch model); each made on first use."""

    def get(family: str):
        if family not in _MADE:
            directory = str(tmp_path_factory.mktemp(f"hf_{family}"))
            _MADE[family] = (directory, make_hf_model(family, directory))
        return _MADE[family]

    return get


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def family(request):
    return request.param
