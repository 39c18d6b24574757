import pytest

from rewardbox.trainer.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), warm_up=False)
