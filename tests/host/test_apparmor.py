"""The AppArmor profile for hosts that confine containers with AppArmor (rewardbox.deploy.apparmor), and the warning for
an engine that does so under Docker's default profile. This machine's kernel has no AppArmor: the profile is
compiled by the real apparmor_parser, not enforced (tests/docker/test_hardening checks it reaches the engine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rewardbox.deploy import apparmor
from rewardbox.backends.docker import DockerSettings, apparmor_warning
from rewardbox.errors import BackendError, ConfigError
from rewardbox.spec import load_config


def _rules(text: str) -> list:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_profile_compiles_with_this_hosts_apparmor_parser_and_allows_docker_defaults_rules_and_three_mounts():
    assert apparmor.parser(), "no apparmor_parser: scripts/setup.sh installs Debian's apparmor package"
    text = apparmor.profile()
    apparmor.check(text)  # raises with the parser's message where it refuses it
    rules = _rules(text)
    assert rules[0] == "abi <abi/3.0>,"  # the ABI Docker's own profile is written against, known to parsers 3 and 4
    # only the private /tmp's mounts: the /proc remount (hidepid), / made private, a slot's directory bound on /tmp
    assert [rule for rule in rules if re.match(r"(deny )?(mount|remount)\b", rule)] == [
        "remount options in (rw, nosuid, nodev, noexec, relatime) /proc/,",
        "mount options in (rw, remount, nosuid, nodev, noexec, relatime) -> /proc/,",
        "mount options in (rw, rprivate) -> /,",
        "mount options in (rw, bind) /tmp/slot-*/ -> /tmp/,",
    ]
    # docker-default's confinement stays: no writes in /proc's own files nor /sys, no kcore, no sysrq
    for rule in ("deny @{PROC}/* w,", "deny @{PROC}/sysrq-trigger rwklx,", "deny @{PROC}/kcore rwklx,",
                 "deny /sys/kernel/security/** rwklx,", "deny /sys/firmware/** rwklx,", "deny network vsock,"):
        assert rule in rules
    # signals and ptrace only between processes of this profile (and from the engine and the OCI runtime)
    assert "signal (send,receive) peer=rewardbox-sandbox," in rules
    assert "ptrace (trace,tracedby,read,readby) peer=rewardbox-sandbox," in rules
    assert "userns," not in rules


def test_a_profile_the_parser_refuses_says_what_it_said():
    broken = apparmor.profile().replace("  mount options in (rw, rprivate) -> /,\n", "  mount bogus\n")
    with pytest.raises(BackendError, match="refused the profile.*syntax error"):
        apparmor.check(broken)


def test_hosts_that_force_user_namespace_mediation_get_abi_4_and_a_userns_rule():
    text = apparmor.profile(userns=True)
    rules = _rules(text)
    assert rules[0] == "abi <abi/4.0>," and rules.count("userns,") == 1
    version = subprocess.run([apparmor.parser(), "--version"], capture_output=True, text=True).stdout
    if not re.search(r"version [0-3]\.", version):  # AppArmor 4's parser: it must compile too
        apparmor.check(text)


@pytest.mark.parametrize("name", ["", "a b", "x;y", "../etc", "-x", "p" * 65, "docker-default", "unconfined"])
def test_a_profile_name_that_is_not_a_plain_name_of_our_own_is_refused(name):
    with pytest.raises(BackendError, match="letters, digits|the engine's own"):
        apparmor.profile(name)


def test_the_cli_prints_the_profile():
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "apparmor", "--name", "rbx-test"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == apparmor.profile("rbx-test")
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "apparmor", "--name", "docker-default"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "the engine's own" in proc.stdout + proc.stderr


def test_install_loads_the_profile_or_says_why_not_and_never_overwrites_a_file_it_did_not_write(tmp_path):
    text = apparmor.profile("rbx-test")
    if os.geteuid() != 0:
        with pytest.raises(BackendError, match="needs root"):
            apparmor.install(text, "rbx-test", tmp_path)
        return
    (tmp_path / "rbx-test").write_text("# a profile of the host's own\n")
    with pytest.raises(BackendError, match="not written by rewardbox"):
        apparmor.install(text, "rbx-test", tmp_path)
    assert (tmp_path / "rbx-test").read_text() == "# a profile of the host's own\n"
    (tmp_path / "rbx-test").unlink()
    enabled = Path("/sys/module/apparmor/parameters/enabled")
    if enabled.exists() and enabled.read_text().strip() == "Y":
        assert apparmor.install(text, "rbx-test", tmp_path) == tmp_path / "rbx-test"
        assert (tmp_path / "rbx-test").read_text() == text
        subprocess.run([apparmor.parser(), "--remove", str(tmp_path / "rbx-test")], check=True)
    else:  # this machine: the kernel has no AppArmor
        with pytest.raises(BackendError, match="could not load .*is AppArmor enabled in this kernel"):
            apparmor.install(text, "rbx-test", tmp_path)
        assert not (tmp_path / "rbx-test").exists()  # nothing left that the host would load at its next boot


def test_an_engine_that_confines_containers_with_apparmor_gets_a_warning_naming_the_fix():
    confined = {"SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"]}
    warning = apparmor_warning(confined, DockerSettings())
    assert warning and "rewardbox apparmor --install" in warning and "sandbox.docker.apparmor_profile" in warning
    assert apparmor_warning(confined, DockerSettings(apparmor_profile="docker-default")) == warning
    # not where a profile of the user's is named, /tmp is not private anyway, gVisor mounts in its own kernel, or
    # the engine has no AppArmor
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
