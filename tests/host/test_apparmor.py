"""The AppArmor profile for hosts that confine containers with AppArmor (rewardbox.apparmor), and the warning for
an engine that does so under Docker's default profile. This machine's kernel has no AppArmor: the profile is
compiled by the real apparmor_parser, not enforced (tests/docker/test_hardening checks it reaches the engine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rewardbox import apparmor
from rewardbox.backends.docker import DockerSettings, apparmor_warning
from rewardbox.errors import BackendError, ConfigError
from rewardbox.spec import load_config


def test_the_profile_compiles_with_this_hosts_apparmor_parser_and_allows_only_what_docker_default_does_and_mounts():
    assert apparmor.parser(), "no apparmor_parser: scripts/setup.sh installs Debian's apparmor package"
    text = apparmor.profile()
    apparmor.check(text)  # raises with the parser's message where it refuses it
    rules = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert "mount," in rules and not any(rule.startswith("deny mount") for rule in rules)
    # docker-default's confinement stays: no writes in /proc's own files nor /sys, no kcore, no sysrq
    for rule in ("deny @{PROC}/* w,", "deny @{PROC}/sysrq-trigger rwklx,", "deny @{PROC}/kcore rwklx,",
                 "deny /sys/kernel/security/** rwklx,", "deny /sys/firmware/** rwklx,", "deny network vsock,"):
        assert rule in rules
    # signals and ptrace only between processes of this profile (and from the engine and the OCI runtime)
    assert "signal (send,receive) peer=rewardbox-sandbox," in rules
    assert "ptrace (trace,tracedby,read,readby) peer=rewardbox-sandbox," in rules
    assert "userns," not in rules  # AppArmor 3's parser (Debian 12) refuses the rule


def test_a_profile_the_parser_refuses_says_what_it_said():
    with pytest.raises(BackendError, match="refused the profile.*syntax error"):
        apparmor.check(apparmor.profile().replace("  mount,\n", "  mount bogus\n"))


def test_apparmor_4_gets_user_namespaces_and_its_abi():
    text = apparmor.profile(userns=True)
    assert text.count("userns,") == 1 and "abi <abi/4.0>," in text
    if (apparmor.parser_major() or 0) >= 4:
        apparmor.check(text)


@pytest.mark.parametrize("name", ["", "a b", "x;y", "../etc", "-x", "p" * 65])
def test_a_profile_name_that_is_not_a_plain_name_is_refused(name):
    with pytest.raises(BackendError, match="letters, digits"):
        apparmor.profile(name)


def test_the_cli_prints_the_profile():
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "apparmor", "--name", "rbx-test", "--no-userns"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == apparmor.profile("rbx-test")


def test_install_writes_the_profile_and_loads_it_or_says_why_not(tmp_path):
    kernel_has_apparmor = Path("/sys/module/apparmor/parameters/enabled").exists()
    text = apparmor.profile("rbx-test")
    if kernel_has_apparmor:
        assert apparmor.install(text, "rbx-test", tmp_path) == tmp_path / "rbx-test"
        subprocess.run([apparmor.parser(), "--remove", str(tmp_path / "rbx-test")], check=True)
    else:
        with pytest.raises(BackendError, match="could not load .*is AppArmor enabled in this kernel"):
            apparmor.install(text, "rbx-test", tmp_path)
    assert (tmp_path / "rbx-test").read_text() == text


def test_an_engine_that_confines_containers_with_apparmor_gets_a_warning_naming_the_fix():
    confined = {"SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"]}
    warning = apparmor_warning(confined, DockerSettings())
    assert warning and "rewardbox apparmor --install" in warning and "sandbox.docker.apparmor_profile" in warning
    # not where the profile is named, /tmp is not private anyway, gVisor mounts in its own kernel, or no AppArmor
    assert apparmor_warning(confined, DockerSettings(apparmor_profile="rewardbox-sandbox")) is None
    assert apparmor_warning(confined, DockerSettings(private_tmp="off")) is None
    assert apparmor_warning(confined, DockerSettings(runtime="runsc")) is None
    assert apparmor_warning({"SecurityOptions": ["name=seccomp,profile=builtin"]}, DockerSettings()) is None
    assert apparmor_warning({}, DockerSettings()) is None


def test_a_bad_profile_name_in_the_config_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "r.py").write_text("def r(prompt, completion, example):\n    return 1.0\n")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"sandbox": {"backend": "docker", "docker": {"apparmor_profile": "a b"}},
                                    "rewards": [{"source": "r.py"}]}))
    with pytest.raises(ConfigError, match="apparmor_profile"):
        load_config(path)
