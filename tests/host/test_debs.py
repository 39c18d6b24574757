"""system_packages without an engine: validation, image keys and tags, the build context's debs/ folder, how the
image's apt files are copied, and the errors a user sees. The real downloads and builds are in
tests/docker/test_system_packages.py."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from rewardbox import ConfigError, ImageBuildError, load_config
from rewardbox.images import debs
from rewardbox.backends.docker import DockerSettings
from rewardbox.images.image import ImageTarget, content_hash, image_key
from rewardbox.spec import RewardSpec

OK = "def exec_reward(prompt, completion, example):\n    return 1.0\n"
TARGET = ImageTarget(python="3.11", machine="x86_64", libc=("glibc", "2.36"))
BOOKWORM = debs.BaseSystem(architecture="amd64", release="Debian GNU/Linux 12 (bookworm)", codename="bookworm",
                           distribution="debian")


def no_apt(*args, **kwargs):
    raise AssertionError("apt-get must not run")


@pytest.mark.parametrize("bad", ["G++", "-o", "x", "jq=", "jq 1.6", "nodejs;reboot", "../jq", "jq=1.6 2"])
def test_a_bad_system_package_is_named_with_its_reward_index_and_line(write_config, bad):
    path = write_config([{"name": "exec_reward", "code": OK, "system_packages": ["g++", bad]}])
    # write_config writes sandbox (1), backend (2), rewards (3), source (4), name (5), system_packages (6)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert "rewardbox.yaml:6: rewards[0].system_packages: " in message
    assert f"reward 'exec_reward': system_packages[1] {bad!r} is not a Debian package name" in message


def test_debian_names_and_pinned_versions_are_accepted(write_config):
    names = ["g++", "nodejs", "libc6-dev", "python3.11", "jq=1.6-2.1+deb12u2", "libstdc++6=12.2.0-14",
             "tzdata=2024a-0+deb12u1", "openjdk-17-jdk-headless=17.0.12+7-2~deb12u1", "lib32z1=1:1.2.13"]
    config = load_config(write_config([{"name": "exec_reward", "code": OK, "system_packages": names}]))
    assert config.rewards[0].system_packages == names


def test_system_packages_from_is_host_by_default_or_build():
    assert DockerSettings().system_packages_from == "host"
    assert DockerSettings(system_packages_from="build").system_packages_from == "build"
    with pytest.raises(ValueError, match="'host' or 'build'"):
        DockerSettings(system_packages_from="mirror")


def test_the_image_key_is_the_pip_and_the_system_packages_each_sorted():
    reward = RewardSpec(name="r", source="r.py", packages=["sympy", "emoji"], system_packages=["nodejs", "g++"])
    assert image_key(reward) == (("emoji", "sympy"), ("g++", "nodejs"))
    same = RewardSpec(name="s", source="s.py", packages=["emoji", "sympy"], system_packages=["g++", "nodejs"])
    assert image_key(same) == image_key(reward)
    assert image_key(RewardSpec(name="t", source="t.py", packages=["emoji", "sympy"])) == (("emoji", "sympy"), ())


def test_the_tag_changes_with_the_system_packages_and_where_they_come_from_and_not_with_their_order():
    def digest(system=(), source="host"):
        return content_hash("sha256:base", TARGET, ["emoji"], [], system_packages=system, system_packages_from=source)

    assert digest(["g++", "nodejs"]) == digest(["nodejs", "g++"])
    assert len({digest(), digest(["jq"]), digest(["g++", "nodejs"]), digest(["jq"], "build")}) == 4
    # no system packages: where they would come from does not matter, and the hash is the one without the keyword
    assert digest([], "build") == digest([], "host") == content_hash("sha256:base", TARGET, ["emoji"], [])


def test_without_system_packages_the_debs_folder_is_empty_and_nothing_is_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(debs, "run_apt", no_apt)
    debs.prepare_debs(None, "rewardbox/base:bookworm", "sha256:base", [], "host", tmp_path / "cache",
                      tmp_path / "debs")
    assert list((tmp_path / "debs").iterdir()) == []


def test_the_build_mode_only_lists_the_packages_for_the_dockerfile(tmp_path, monkeypatch):
    monkeypatch.setattr(debs, "run_apt", no_apt)
    debs.prepare_debs(None, "rewardbox/base:bookworm", "sha256:base", ["nodejs", "g++"], "build",
                      tmp_path / "cache", tmp_path / "debs")
    assert [p.name for p in (tmp_path / "debs").iterdir()] == [debs.INSTALL_LIST]
    assert (tmp_path / "debs" / debs.INSTALL_LIST).read_text() == "g++\nnodejs\n"


def test_a_name_that_bypassed_the_config_is_refused_before_apt(tmp_path, monkeypatch):
    monkeypatch.setattr(debs, "run_apt", no_apt)
    with pytest.raises(ImageBuildError, match=r"system package '--reinstall' \(needed by reward 'r'\) is not a "
                                              r"Debian package name"):
        debs.prepare_debs(None, "img", "sha256:base", ["--reinstall"], "host", tmp_path, tmp_path / "debs", ["r"])


def test_a_host_without_apt_get_is_told_to_download_in_the_build(tmp_path, monkeypatch):
    monkeypatch.setattr(debs.shutil, "which", lambda name: None)
    with pytest.raises(ImageBuildError) as e:
        debs.download_debs(None, "img", "sha256:base", ["g++"], tmp_path, owners=["exec_reward"])
    assert "(needed by reward 'exec_reward')" in str(e.value)
    assert "system packages are downloaded with the host's apt-get" in str(e.value)
    assert "`sandbox.docker.system_packages_from: build`" in str(e.value)


def test_a_cached_download_asks_neither_the_engine_nor_apt(tmp_path, monkeypatch):
    monkeypatch.setattr(debs, "run_apt", no_apt)
    cached = tmp_path / "debs" / debs.debs_key("sha256:base", ["jq"])
    cached.mkdir(parents=True)
    (cached / "jq_1.6_amd64.deb").write_bytes(b"deb")
    (cached / ".complete").touch()
    debs.prepare_debs(None, "img", "sha256:base", ["jq"], "host", tmp_path, tmp_path / "context" / "debs")
    assert [p.name for p in (tmp_path / "context" / "debs").iterdir()] == ["jq_1.6_amd64.deb"]
    assert debs.debs_key("sha256:base", ["a", "b"]) == debs.debs_key("sha256:base", ["b", "a"])
    assert debs.debs_key("sha256:other", ["a", "b"]) != debs.debs_key("sha256:base", ["a", "b"])


@pytest.mark.parametrize("said, named", [
    ("E: Unable to locate package nosuch", "nosuch"),
    ("E: Package 'virtual' has no installation candidate", "virtual"),
    ("E: Version '9.9' for 'jq' was not found", "jq=9.9"),
    ("E: Couldn't find any package by glob 'no.such'", "no.such"),
])
def test_an_unknown_package_is_named_with_its_rewards_and_release(said, named):
    message = debs._explain_apt_failure(["Reading package lists...", said], [named], ["a", "b"], BOOKWORM)
    assert message.startswith(f"system package {named!r} (needed by reward 'a', 'b') does not exist in Debian "
                              "GNU/Linux 12 (bookworm) for amd64, in the base image's sources")
    assert "check the name on packages.debian.org (release bookworm)" in message
    assert message.endswith(said)


def _tarball(entries: list[tuple[str, str, bytes]]) -> bytes:
    """A tarball of (name, link target or '', content) entries, as the engine's get_archive returns."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, link, content in entries:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def test_the_images_files_land_under_the_copy_and_links_point_inside_it(tmp_path):
    root = tmp_path / "image"
    debs._extract(_tarball([("keyrings/debian.gpg", "", b"key")]), "/usr/share", root)
    debs._extract(_tarball([
        ("apt/trusted.gpg.d/debian.gpg", "/usr/share/keyrings/debian.gpg", b""),  # absolute: made relative
        ("apt/trusted.gpg.d/shadow.gpg", "/etc/../../../etc/shadow", b""),  # leaves the image: dropped
        ("apt/../../../../escape", "", b"x"),  # a name outside the image: dropped
        ("apt/sources.list", "", b"deb http://deb.debian.org/debian bookworm main\n"),
    ]), "/etc", root)
    link = root / "etc" / "apt" / "trusted.gpg.d" / "debian.gpg"
    assert link.is_symlink() and not Path(link.readlink()).is_absolute() and link.read_bytes() == b"key"
    assert not (root / "etc" / "apt" / "trusted.gpg.d" / "shadow.gpg").exists()
    assert not (tmp_path.parent / "escape").exists() and not (tmp_path / "escape").exists()
    assert (root / "etc" / "apt" / "sources.list").read_text().startswith("deb http")


def test_the_images_sources_name_the_copied_keys(tmp_path):
    root = tmp_path / "image"
    (root / "etc" / "apt" / "sources.list.d").mkdir(parents=True)
    (root / "etc" / "apt" / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    (root / "etc" / "apt" / "sources.list").write_text(
        "deb [arch=amd64 signed-by=/etc/apt/keyrings/nodesource.gpg] https://deb.nodesource.com/node_20.x nodistro "
        "main\n")
    assert debs._signed_by_paths(root) == ["/etc/apt/keyrings/nodesource.gpg",
                                           "/usr/share/keyrings/debian-archive-keyring.gpg"]
    debs._point_signed_by_at_copies(root)
    assert f"Signed-By: {root}/usr/share/keyrings/debian-archive-keyring.gpg\n" in \
        (root / "etc" / "apt" / "sources.list.d" / "debian.sources").read_text()
    assert f"signed-by={root}/etc/apt/keyrings/nodesource.gpg]" in (root / "etc" / "apt" / "sources.list").read_text()


def test_apt_get_acts_for_the_image_copy_and_its_architecture(tmp_path):
    options = debs.apt_options(tmp_path, tmp_path / "image", "arm64")
    settings = dict(o.split("=", 1) for o in options[1::2])
    assert set(options[::2]) == {"-o"}
    assert settings["Dir::State::status"] == f"{tmp_path}/image/var/lib/dpkg/status"
    assert settings["Dir::Etc::SourceParts"] == f"{tmp_path}/image/etc/apt/sources.list.d"
    assert settings["Dir::Cache::archives"] == f"{tmp_path}/archives"
    assert settings["APT::Architecture"] == settings["APT::Architectures"] == "arm64"
    assert (tmp_path / "archives" / "partial").is_dir() and (tmp_path / "state" / "lists" / "partial").is_dir()
