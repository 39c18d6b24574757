"""The backend registry: backends by name, each with its own typed settings section, open to other packages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from pydantic import Field

from rewardbox import BackendError, ConfigError, load_config, parse_config
from rewardbox.backends import (
    BackendSettings,
    BackendType,
    backend_names,
    backend_type,
    create_backend,
    register_backend,
)
from rewardbox import registry
from rewardbox.backends.docker import DockerSettings
from rewardbox.backends.local import LocalBackend

OK = "def ok(prompt, completion, example):\n    return 1.0\n"


@pytest.fixture
def clean_registry(monkeypatch):
    """The registry as it is now, restored after the test (registrations are process-wide)."""
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    monkeypatch.setattr(registry, "_pending", dict(registry._pending))
    monkeypatch.setattr(registry, "_entry_points_read", registry._entry_points_read)


class MemorySettings(BackendSettings):
    slots: int = Field(default=1, ge=1)


def memory_backend(settings: MemorySettings) -> LocalBackend:
    backend = LocalBackend()
    backend.made_with = settings
    return backend


MEMORY = BackendType("memory", MemorySettings, memory_backend, isolated=False, summary="a test backend")


def test_the_built_in_backends_are_registered_with_their_settings():
    assert {"docker", "local"} <= set(backend_names())
    assert backend_type("docker").settings_type is DockerSettings and backend_type("docker").isolated
    assert not backend_type("local").isolated


def test_a_backend_section_is_validated_by_its_backend_and_read_typed(write_config):
    path = write_config([{"name": "ok", "code": OK}],
                        {"backend": "docker", "docker": {"runtime": "runsc", "base_image": "python:3.12-slim"}})
    settings = load_config(path).sandbox.backend_settings("docker")
    assert isinstance(settings, DockerSettings)
    assert (settings.runtime, settings.base_image, settings.network_mode) == ("runsc", "python:3.12-slim", "bridge")


def test_a_backend_without_a_section_gets_its_defaults(write_config):
    settings = load_config(write_config([{"name": "ok", "code": OK}], {"backend": "docker"})).sandbox
    assert settings.backend_settings("docker") == DockerSettings() and DockerSettings().base_image == "auto"


def test_a_bad_value_in_a_backend_section_is_named_with_its_line(write_config, tmp_path):
    path = write_config([{"name": "ok", "code": OK}], {"backend": "docker", "docker": {"network_mode": [1]}})
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:4: sandbox\.docker\.network_mode: Input should be a "
                                          r"valid string"):
        load_config(path)


def test_an_unknown_backend_is_named_with_the_registered_ones(write_config):
    path = write_config([{"name": "ok", "code": OK}], {"backend": "dockr"})
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:2: sandbox\.backend: .*no backend named 'dockr'; did "
                                          r"you mean 'docker'\? \(registered: auto, attached, docker, local, ray, remote"):
        load_config(path)


def test_a_backend_setting_in_the_shared_section_says_where_it_belongs(write_config):
    path = write_config([{"name": "ok", "code": OK}], {"backend": "docker", "base_image": "python:3.11-slim"})
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:3: unknown key 'sandbox\.base_image'; it is a setting "
                                          r"of the docker backend: write it as sandbox\.docker\.base_image"):
        load_config(path)


def test_a_backend_registered_at_run_time_gets_its_section_and_is_made_from_it(clean_registry, tmp_path):
    register_backend(MEMORY)
    (tmp_path / "ok.py").write_text(OK)
    config = parse_config({"sandbox": {"backend": "memory", "memory": {"slots": 3}},
                           "rewards": [{"name": "ok", "source": "ok.py"}]}, tmp_path)
    backend = create_backend(config.sandbox)
    assert backend.made_with == MemorySettings(slots=3)
    with pytest.raises(ConfigError, match=r"sandbox\.memory\.slots: Input should be greater than or equal to 1"):
        parse_config({"sandbox": {"backend": "memory", "memory": {"slots": 0}},
                      "rewards": [{"name": "ok", "source": "ok.py"}]}, tmp_path)


def test_a_backend_of_another_package_registers_through_its_entry_point(clean_registry, tmp_path, monkeypatch):
    (tmp_path / "rbx_test_plugin.py").write_text(textwrap.dedent("""
        from rewardbox.backends import BackendSettings, BackendType
        from rewardbox.backends.local import LocalBackend

        class PluginSettings(BackendSettings):
            zone: str = "a"

        BACKEND = BackendType("plugged", PluginSettings, lambda settings: LocalBackend(), isolated=False)
    """))
    dist = tmp_path / "rbx_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rbx-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rewardbox.backends]\nplugged = rbx_test_plugin:BACKEND\n"
                                           "broken = rbx_no_such_module:BACKEND\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    assert {"plugged", "broken"} <= set(backend_names())
    assert "rbx_test_plugin" not in sys.modules  # listed without importing it
    assert backend_type("plugged").settings_type().zone == "a"
    with pytest.raises(BackendError, match=r"backend 'broken' \(rbx_no_such_module:BACKEND\) cannot be loaded: "
                                           r"ModuleNotFoundError"):
        backend_type("broken")


@pytest.mark.parametrize("backend, message", [
    (BackendType("Bad-Name", MemorySettings, memory_backend, False), r"'Bad-Name' must be lower-case"),
    (BackendType("backend", MemorySettings, memory_backend, False), r"'backend' must be .* not one of"),
    (BackendType("memory", dict, memory_backend, False), r"settings_type must be a pydantic model class"),
    (BackendType("docker", MemorySettings, memory_backend, False), r"a backend named 'docker' is already registered"),
])
def test_a_malformed_registration_is_refused_naming_the_problem(clean_registry, backend, message):
    with pytest.raises(BackendError, match=message):
        register_backend(backend)


def test_settings_without_defaults_are_refused_at_registration(clean_registry):
    class NeedsValue(BackendSettings):
        endpoint: str

    with pytest.raises(BackendError, match=r"backend 'needy': every setting of NeedsValue needs a default"):
        register_backend(BackendType("needy", NeedsValue, memory_backend, False))


def test_the_cli_lists_the_backends_and_their_settings():
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "backends"], capture_output=True, text=True,
                          timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert "docker" in proc.stdout and "base_image='auto'" in proc.stdout and "NO" in proc.stdout
