"""Sessions: one isolated test run per package, its floors from wheels, integration, lint, XLA.

nox -t ci                      # everything CI runs
nox -s tests-nxd-layers        # one package, its upstream siblings and its test group only
nox -s lowest                  # every package from wheels at the lowest versions it admits
nox -s wheel-nxd-layers        # one package from wheels at the newest versions it admits
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
# Upstream first: a package's sessions only ever see itself and what it depends on.
PACKAGES = [
    "nxd-state",
    "nxd-layers",
    "nxd-pipeline",
    "nxd-optim",
    "nxd-lora",
    "nxd-ckpt",
    "nxd-trainer",
    "nxd-lightning",
]
# XLA runs on torch-xla 2.9, which needs exactly torch 2.9 (outside the lock, its own venv).
XLA_PINS = ["torch==2.9.0", "torch-xla==2.9.0"]
# Packages whose `xla`-marked tests run there, and the ones they need installed.
XLA_TESTED = ["nxd-state", "nxd-trainer"]
XLA_PACKAGES = [
    "nxd-state",
    "nxd-layers",
    "nxd-pipeline",
    "nxd-optim",
    "nxd-lora",
    "nxd-ckpt",
    "nxd-trainer",
]
# What nxd-train needs there too: the xla session runs the main job end to end.
XLA_THIRD_PARTY = [
    "safetensors",
    "tqdm",
    "transformers>=5.4",
    "tokenizers",
    "tensorboardX",
    "filelock",
    "tomli-w",
]
# Extras a package's own tests need (nxd-trainer's tests run the nxd-train command).
TEST_EXTRAS = {"nxd-trainer": ["train"]}


def _sync(session: nox.Session, *args: str) -> None:
    """``uv sync`` the lock into this session's venv, exactly (extraneous packages removed)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--exact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


def _test_group(package: str) -> list[str]:
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    return pyproject.get("dependency-groups", {}).get("test", [])


def _requirements(package: str, extras: list[str] | None = None) -> list[str]:
    """The ``[project] dependencies`` of ``package`` and of its ``extras``, as written
    (sibling names bare)."""
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    project = pyproject["project"]
    listed = list(project["dependencies"])
    for extra in extras or []:
        listed += project["optional-dependencies"][extra]
    out = []
    for requirement in listed:
        name = requirement.split(";")[0].split("[")[0]
        for stop in "<>=!~ ":
            name = name.split(stop)[0]
        out.append(name if name in PACKAGES else requirement)
    return out


def _upstream(package: str) -> list[str]:
    """``package`` and every workspace sibling it depends on, directly or not."""
    seen: list[str] = []
    pending = [package]
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.append(name)
            pending.extend(dep for dep in _requirements(name) if dep in PACKAGES)
    return seen


def _build_wheels(session: nox.Session) -> Path:
    """Every wheel of the workspace, built as a user's pip sees it (no workspace sources)."""
    dist = Path(session.create_tmp()) / "dist"
    session.run(
        "uv", "build", "--all-packages", "--no-sources", "--out-dir", str(dist), external=True
    )
    return dist


def _wheel(dist: Path, package: str) -> str:
    return str(next(dist.glob(f"{package.replace('-', '_')}-*.whl")))


def _pytest_outside_repo(session: nox.Session, package: str) -> None:
    """Run ``package``'s tests from a temporary folder, so nothing is imported from the source
    tree: only what was installed into the session's venv."""
    tests_dir = ROOT / "packages" / package / "tests"
    session.chdir(session.create_tmp())
    session.run(
        "pytest",
        str(tests_dir),
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "--rootdir",
        str(tests_dir),
        *session.posargs,
    )


for _package in PACKAGES:

    @nox.session(name=f"tests-{_package}", tags=["ci", "tests"])
    def tests(session: nox.Session, package: str = _package) -> None:
        """One package with its upstream siblings and its test group, nothing else."""
        extras = [arg for extra in TEST_EXTRAS.get(package, []) for arg in ("--extra", extra)]
        _sync(session, "--package", package, "--group", "test", *extras)
        session.run("pytest", f"packages/{package}/tests", *session.posargs)

    @nox.session(name=f"wheel-{_package}", tags=["wheels"])
    def wheel(session: nox.Session, package: str = _package) -> None:
        """Install one package from wheels built with workspace sources off; run its tests.

        The resolver sees only the version ranges the wheels declare, which is what proves them.
        """
        dist = _build_wheels(session)
        # Every build is 0.1.0 until a release: without these, a reused venv would keep the
        # installed sibling and uv would serve a same-named wheel cached from an earlier build.
        refresh = [
            arg
            for sibling in PACKAGES
            for arg in ("--refresh-package", sibling, "--reinstall-package", sibling)
        ]
        wheel = _wheel(dist, package)
        extras = TEST_EXTRAS.get(package)
        if extras:  # "nxd-trainer[train] @ file:///.../nxd_trainer-0.1.0-py3-none-any.whl"
            wheel = f"{package}[{','.join(extras)}] @ {Path(wheel).resolve().as_uri()}"
        session.install(wheel, "--find-links", str(dist), *refresh, *_test_group(package))
        _pytest_outside_repo(session, package)


@nox.session(tags=["ci"])
@nox.parametrize("package", PACKAGES)
def lowest(session: nox.Session, package: str) -> None:
    """One package at the LOWEST versions its ranges admit, from wheels: proves the floors.

    The package's own third-party requirements and its test group are passed to the resolver as
    direct requirements with ``--resolution lowest-direct`` (so ``torch>=2.9`` installs 2.9.0);
    the package and its siblings come from wheels built without workspace sources, which also
    proves that the wheels install and that the sibling ranges resolve.
    """
    dist = _build_wheels(session)
    extras = TEST_EXTRAS.get(package, [])
    third_party = [r for r in _requirements(package, extras) if r not in PACKAGES]
    # Only the siblings are reinstalled and refreshed (every build is 0.1.0): a bare
    # `--reinstall` implies `--refresh`, which re-downloads torch and its CUDA wheels (~3 GB)
    # into a new cache entry for every session.
    siblings = [
        arg
        for name in _upstream(package)
        for arg in ("--refresh-package", name, "--reinstall-package", name)
    ]
    session.install(
        "--resolution",
        "lowest-direct",
        *siblings,
        *(_wheel(dist, name) for name in _upstream(package)),
        *third_party,
        *_test_group(package),
    )
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, external=True)
    _pytest_outside_repo(session, package)


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """Every package together (the `nxd` meta-distribution and its compat package)."""
    _sync(session, "--all-packages", "--group", "test")
    session.run("pytest", "tests-integration", *session.posargs)


@nox.session(tags=["ci"])
def reliability(session: nox.Session) -> None:
    """Faults, kills, bad input and hostile files (tests-reliability/); `-- -m slow` for more."""
    _sync(session, "--all-packages", "--group", "test")
    session.run("pytest", "tests-reliability", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff at the locked version (the root `dev` group), so local and CI agree."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["ci"])
def xla(session: nox.Session) -> None:
    """Single-device tests on torch-xla's CPU client (PJRT_DEVICE=CPU), torch 2.9."""
    session.install(*XLA_PINS, *XLA_THIRD_PARTY, "pytest", "numpy")
    for package in XLA_PACKAGES:
        session.install("--no-deps", "-e", f"packages/{package}")
    session.run(
        "pytest",
        "-m",
        "xla",
        *(f"packages/{p}/tests" for p in XLA_TESTED),
        *session.posargs,
        env={"PJRT_DEVICE": "CPU", "NXD_DEVICE": "xla"},
    )
