"""What the service image (`rewardbox serve`) installs."""

from importlib import metadata

from rewardbox.images.image import service_requirements


def test_the_service_image_pins_the_core_dependencies_and_the_openrlhf_endpoints_not_the_trainers():
    pinned = dict(r.split("==") for r in service_requirements())
    assert pinned["grpcio"] == metadata.version("grpcio")
    assert pinned["aiohttp"] == metadata.version("aiohttp")  # rewardbox serve --openrlhf (installed here by setup)
    assert not {"torch", "trl", "transformers", "ray"} & set(pinned)
