"""pyproject.toml, constraints.txt, requirements.txt, LICENSE and the generated stubs agree
with each other and with the code (no build, no network: runs everywhere)."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.packaging import _util

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

packaging_requirements = pytest.importorskip("packaging.requirements")
Requirement = packaging_requirements.Requirement


def pyproject():
    with open(_util.ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def constraints():
    pins = {}
    for line in (_util.ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


def test_project_metadata():
    project = pyproject()["project"]
    assert project["name"] == "ft-torch"
    assert project["dynamic"] == ["version"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    licence = (_util.ROOT / "LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License") and "the ft authors" in licence
    from ft._version import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", __version__)


def test_console_scripts_name_functions_that_exist():
    scripts = pyproject()["project"]["scripts"]
    assert scripts["ft-lighthouse"] == "ft.coordination.cli:main"
    assert scripts["ft-launch"] == "ft.launch.cli:main"
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_every_pin_lies_in_the_declared_ranges():
    """constraints.txt is one point inside pyproject.toml's ranges (runtime, build, test)."""
    data = pyproject()
    pins = constraints()
    declared = (
        data["project"]["dependencies"]
        + data["build-system"]["requires"]
        + [r for extra in data["project"]["optional-dependencies"].values() for r in extra]
    )
    for line in declared:
        req = Requirement(line)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is declared but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    requirements = (_util.ROOT / "requirements.txt").read_text()
    assert re.search(r"^-c constraints\.txt$", requirements, re.M)
    for line in requirements.splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            pin = pins.get(req.name.lower().replace("_", "-"))
            assert pin and req.specifier.contains(pin, prereleases=True), (line, pin)


def test_protobuf_ceiling_matches_the_stubs_gencode():
    """The stubs are protobuf gencode of one major; protobuf's runtime supports gencode of its
    own major, so the declared range must stop before the next one."""
    stub = (_util.ROOT / "ft" / "coordination" / "_proto" / "torchft_pb2.py").read_text()
    major = int(re.search(r"^# Protobuf Python Version: (\d+)\.", stub, re.M).group(1))
    (protobuf,) = [
        Requirement(r) for r in pyproject()["project"]["dependencies"] if r.startswith("protobuf")
    ]
    assert f"<{major + 1}" in [str(s) for s in protobuf.specifier], protobuf
    assert protobuf.specifier.contains(f"{major}.99") and not protobuf.specifier.contains(
        f"{major + 1}.0"
    )


def test_setup_py_reads_the_version_and_needs_no_other_metadata():
    text = (_util.ROOT / "setup.py").read_text()
    call = text[text.rindex("setup(") :]
    for field in (
        "name=",
        "install_requires=",
        "entry_points=",
        "extras_require=",
        "package_data=",
        "python_requires=",
    ):
        assert field not in call, f"{field} belongs in pyproject.toml"
