"""Sessions: one isolated test run per package, the version points from wheels, integration, XLA.

nox -t ci                      # everything CI runs
nox -s tests-nxd-layers        # one package, its upstream siblings and its test group only
nox -s lowest                  # every package from wheels at the lowest versions admitted
nox -s middle                  # ... at torch 2.11 + transformers 5.17 (each: a share of the
                               # test functions, first case; `-- --every-case` for all)
nox -s smoke                   # each wheel alone, declared dependencies only, its main use
nox -s wheel-nxd-layers        # one package from wheels at the newest versions it admits
"""

from __future__ import annotations

import os
import shutil
import time
import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
# Every session's Python caches the bytecode of what it imports (the default). A machine that
# sets PYTHONDONTWRITEBYTECODE (some CI images do) makes every process compile torch's and
# transformers' sources again: 15-20 s per process on 2 cores, and the suites start hundreds
# (each nxd-train run is a launcher and its workers).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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
# The packages `lint` type-checks (mypy, [tool.mypy] in the root pyproject): every package and
# the NxD compat layer, each at zero errors and strict (the same list as [tool.mypy]'s strict
# override).
MYPY_PACKAGES = [
    "nxd_state",
    "nxd_layers",
    "nxd_pipeline",
    "nxd_optim",
    "nxd_lora",
    "nxd_ckpt",
    "nxd_trainer",
    "nxd_lightning",
    "neuronx_distributed",
]
# Extras a package's own tests need (nxd-trainer's tests run the nxd-train command).
TEST_EXTRAS = {"nxd-trainer": ["train"]}
# One point inside the declared ranges, between the floors (`lowest`) and the lock (`tests-*`).
MIDDLE_PINS = ["torch==2.11.*", "transformers==5.17.*"]
# The smoke runs: a venv per distribution, then (requirement, script) in order in that venv.
# A requirement is a built wheel, with an extra where one is named; nothing else is installed
# beyond what the wheels declare. Scripts are in smoke/.
SMOKE = {
    "nxd-state": [("nxd-state", "smoke_nxd_state.py")],
    "nxd-layers": [("nxd-layers", "smoke_nxd_layers.py")],
    "nxd-pipeline": [("nxd-pipeline", "smoke_nxd_pipeline.py")],
    "nxd-optim": [("nxd-optim", "smoke_nxd_optim.py")],
    "nxd-lora": [("nxd-lora", "smoke_nxd_lora.py")],
    "nxd-ckpt": [("nxd-ckpt", "smoke_nxd_ckpt.py")],
    "nxd-trainer": [
        ("nxd-trainer", "smoke_nxd_trainer.py"),  # the training API without any extra
        ("nxd-trainer[train]", "smoke_nxd_train.py"),  # then the extra: the nxd-train command
    ],
    "nxd-lightning": [("nxd-lightning", "smoke_nxd_lightning.py")],
    "open-nxd": [("open-nxd", "smoke_open_nxd.py")],
    # The extra resolves torch-xla beside the torch it was built for; XLA_PINS keep it to the
    # wheels the xla session already fetched (inside the extra's range).
    "nxd-state[xla]": [("nxd-state[xla]", "smoke_nxd_state_xla.py")],
}


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


def _extras(package: str) -> list[str]:
    """The extras of ``package`` an environment of PyPI packages can hold (not ``xla``, which
    needs torch-xla's torch, nor ``neuron``, which needs the Neuron package repository)."""
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    extras = pyproject["project"].get("optional-dependencies", {})
    return [name for name in extras if name not in ("xla", "neuron")]


def _build_wheels(session: nox.Session) -> Path:
    """Every wheel of the workspace, built as a user's pip sees it (no workspace sources)."""
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)  # no wheel of an earlier version left to be picked
    session.run(
        "uv", "build", "--all-packages", "--no-sources", "--out-dir", str(dist), external=True
    )
    return dist


def _wheel(dist: Path, package: str) -> str:
    return str(next(dist.glob(f"{package.replace('-', '_')}-*.whl")))


def _python_floor() -> str:
    """The lowest Python every project admits (``requires-python = ">=3.11"`` -> ``3.11``)."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    return spec.removeprefix(">=")


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
def lowest(session: nox.Session) -> None:
    """Every package at the LOWEST versions its ranges admit, from wheels: proves the floors.

    Every package's third-party requirements (with its extras) and test group are passed to the
    resolver as direct requirements with ``--resolution lowest-direct`` (so ``torch>=2.9``
    installs 2.9.0; the packages declare the same floor for a shared dependency, so one
    environment is each package's lowest); the packages come from wheels built without
    workspace sources, which also proves that the wheels install and that the sibling ranges
    resolve. Runs the first case of a third of the test functions (.ci/sample_tests.py;
    `middle` runs another third; the last third runs at the lock only, in `tests-*`):
    ``nox -s lowest -- --every-case`` runs every case.
    """
    _from_wheels(session, ["--resolution", "lowest-direct"], share="0/3")


@nox.session(tags=["ci"])
def middle(session: nox.Session) -> None:
    """Every package from wheels at a MIDDLE point of the ranges: torch 2.11 and transformers
    5.17 (MIDDLE_PINS, as constraints), everything else at the newest version the ranges admit.
    Runs the first case of another third of the test functions (``-- --every-case``: all)."""
    constraints = Path(session.create_tmp()) / "middle-constraints.txt"
    constraints.write_text("\n".join(MIDDLE_PINS) + "\n")
    _from_wheels(session, ["--constraint", str(constraints)], share="1/3")


def _from_wheels(session: nox.Session, resolver: list[str], share: str) -> None:
    """Install every package from freshly built wheels, with their third-party requirements,
    extras and test groups as direct requirements resolved with ``resolver`` options; run the
    ``share`` of their test functions (first case each) from outside the source tree."""
    dist = _build_wheels(session)
    third_party: list[str] = []
    for package in PACKAGES:
        for requirement in [
            *_requirements(package, _extras(package)),
            *_test_group(package),
        ]:
            if requirement not in PACKAGES and requirement not in third_party:
                third_party.append(requirement)
    # Only the siblings are reinstalled and refreshed (every build is 0.1.0): a bare
    # `--reinstall` implies `--refresh`, which re-downloads torch and its CUDA wheels (~3 GB)
    # into a new cache entry for every session.
    siblings = [
        arg for name in PACKAGES for arg in ("--refresh-package", name, "--reinstall-package", name)
    ]
    session.install(
        *resolver,
        *siblings,
        *(_wheel(dist, name) for name in PACKAGES),
        *third_party,
    )
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, external=True)
    tests = [str(ROOT / "packages" / package / "tests") for package in PACKAGES]
    session.chdir(session.create_tmp())
    session.run(
        "pytest",
        *tests,
        "-p",
        "no:cacheprovider",
        "-p",
        "sample_tests",
        "--import-mode=importlib",
        "--rootdir",
        str(ROOT / "packages"),
        "--one-case-per-test",
        "--share",
        share,
        *session.posargs,
        env={"PYTHONPATH": str(ROOT / ".ci")},
    )


@nox.session(tags=["ci"])
def smoke(session: nox.Session) -> None:
    """Each distribution's wheel alone in a fresh venv, declared dependencies only: its main use.

    As a user installs it: the wheel at Python's floor, only what it declares (no test group),
    then a script of its main use (SMOKE, smoke/).

    First ``smoke/check_release.py`` checks the built wheels' metadata (LICENSE, classifiers,
    URLs, links) and that every import of the sources is declared, and ``twine check`` reads
    them as the index will. ``nox -s smoke -- nxd-ckpt open-nxd`` runs only those entries.
    """
    dist = _build_wheels(session).resolve()
    session.run("python", "smoke/check_release.py", str(dist))
    session.install("twine>=6.1")  # what RELEASING.md runs before an upload
    built = sorted([*dist.glob("*.whl"), *dist.glob("*.tar.gz")])
    session.run("twine", "check", "--strict", *map(str, built))
    unknown = sorted(set(session.posargs) - set(SMOKE))
    if unknown:
        session.error(f"no smoke entry {unknown}; the entries are {sorted(SMOKE)}")
    tmp = Path(session.create_tmp()).resolve()
    xla_constraints = tmp / "xla-constraints.txt"
    xla_constraints.write_text("\n".join(XLA_PINS) + "\n")
    refresh = [arg for name in ["open-nxd", *PACKAGES] for arg in ("--refresh-package", name)]
    for entry, steps in SMOKE.items():
        if session.posargs and entry not in session.posargs:
            continue
        start = time.perf_counter()
        venv = tmp / "venvs" / entry.replace("[", "-").replace("]", "")
        session.run(
            "uv",
            "venv",
            "--clear",
            "--quiet",
            "--python",
            _python_floor(),
            str(venv),
            external=True,
        )
        python = str(venv / "bin" / "python")
        for requirement, script in steps:
            name, _, extra = requirement.partition("[")
            wheel = Path(_wheel(dist, name)).resolve().as_uri()
            spec = f"{name}[{extra} @ {wheel}" if extra else f"{name} @ {wheel}"
            constraints = ["--constraint", str(xla_constraints)] if "xla" in extra else []
            install = ["uv", "pip", "install", "--quiet", "--python", python]
            install += ["--find-links", str(dist), *refresh, *constraints, spec]
            session.run(*install, external=True)
            env = {"PJRT_DEVICE": "CPU"} if "xla" in extra else {}
            # From a scratch folder: only the installed packages can be imported.
            session.chdir(tmp)
            session.run(python, str(ROOT / "smoke" / script), external=True, env=env)
            session.chdir(ROOT)
        session.log(f"smoke {entry}: passed in {time.perf_counter() - start:.0f} s")


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """Every package together (the `open-nxd` meta-distribution and its compat package)."""
    _sync(session, "--all-packages", "--group", "test")
    session.run("pytest", "tests-integration", *session.posargs)


@nox.session(tags=["ci"])
def reliability(session: nox.Session) -> None:
    """Faults, kills, bad input and hostile files (tests-reliability/); `-- -m slow` for more."""
    _sync(session, "--all-packages", "--group", "test")
    session.run("pytest", "tests-reliability", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff, the type checker and the import contracts at the locked versions (the root `dev`
    group), and the sources' release checks.

    ruff, mypy and import-linter from the lock, so local and CI agree; smoke/check_release.py:
    every import declared, the LICENSE copies, no relative link in a README that ships on the
    index. mypy reads torch's, Lightning's and transformers' own types, so the whole workspace
    is installed (MYPY_PACKAGES are checked; their siblings are analysed for types only)."""
    _sync(session, "--all-packages", "--group", "dev", "--group", "test")  # mypy reads pytest
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *(arg for name in MYPY_PACKAGES for arg in ("-p", name)))
    # The import contracts (root pyproject: the package edge, no circle inside a package) read
    # the sources statically: they need the packages findable, not installed.
    sources = [str(path) for path in sorted((ROOT / "packages").glob("*/src"))]
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join([*sources, str(ROOT / "src")])})
    session.run("python", "smoke/check_release.py")


@nox.session(tags=["ci"])
def xla(session: nox.Session) -> None:
    """Single-device tests on torch-xla's CPU client (PJRT_DEVICE=CPU), torch 2.9."""
    # As constraints too: the root pyproject's uv override (`torch>=2.9`, for the lock) also
    # applies to `uv pip install` run here and would replace a plain `torch==2.9.0`.
    constraints = Path(session.create_tmp()) / "xla-constraints.txt"
    constraints.write_text("\n".join(XLA_PINS) + "\n")
    pins = ["--constraint", str(constraints), *XLA_PINS]
    session.install(*pins, *XLA_THIRD_PARTY, "pytest", "numpy")
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
