"""What a release promises, checked without installing anything (standard library only).

    python smoke/check_release.py            # the sources: imports, LICENSE copies, READMEs
    python smoke/check_release.py DIST_DIR   # and the built wheels and sdists in DIST_DIR

- Every third-party module a distribution's sources import is declared by that distribution:
  in ``dependencies``, or in an extra for the modules only an extra's users reach (an import
  inside ``try: ... except ImportError`` or probed with ``find_spec`` is optional by design).
  ``Tensor.numpy()`` and ``safetensors.torch.save_file`` import numpy, which torch and
  safetensors do not install: a package calling them declares numpy itself.
- The LICENSE (Apache-2.0) is in the repository root and, byte for byte, in every project
  folder, named by ``license-files``.
- A README that ships on the index has no relative link (dead on the project page).
- Built wheels carry the license file, License-Expression, classifiers, project URLs and
  Requires-Python; every sdist holds the LICENSE.

Exits 1 with one line per problem.
"""

from __future__ import annotations

import ast
import email.parser
import re
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Import name -> distribution name, for every third-party module the sources import. An import
# missing here is reported: add it with the distribution that provides it.
IMPORT_TO_DIST = {
    "datasets": "datasets",
    "filelock": "filelock",
    "isal": "isal",
    "lightning": "lightning",
    "lightning_utilities": "lightning-utilities",
    "numpy": "numpy",
    "pyarrow": "pyarrow",
    "pytest": "pytest",
    "safetensors": "safetensors",
    "tensorboardX": "tensorboardx",
    "tokenizers": "tokenizers",
    "tomli_w": "tomli-w",
    "torch": "torch",
    "torch_neuronx": "torch-neuronx",
    "torch_xla": "torch-xla",
    "tqdm": "tqdm",
    "transformers": "transformers",
}
# Imports a distribution leaves undeclared on purpose, each with the reason.
UNDECLARED = {
    ("nxd-ckpt", "transformers"): "nxd_ckpt.testing's tiny Llama, a test helper that says so",
}
# safetensors.torch functions that go through numpy (safetensors' `_tobytes`).
_SAFETENSORS_NUMPY = {"save", "save_file"}
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
_ABSOLUTE = re.compile(r"^(?:https?|mailto):", re.IGNORECASE)


def normalize(name: str) -> str:
    """PEP 503 name: lowercase, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0])


@dataclass
class Project:
    """One distribution of the workspace: its folder, import package and declarations."""

    folder: Path
    pyproject: dict
    name: str = ""
    module: str = ""
    base: set[str] = field(default_factory=set)
    extras: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        project = self.pyproject["project"]
        self.name = normalize(project["name"])
        backend = self.pyproject.get("tool", {}).get("uv", {}).get("build-backend", {})
        self.module = backend.get("module-name", project["name"].replace("-", "_"))
        self.base = {requirement_name(r) for r in project.get("dependencies", [])}
        for requirements in project.get("optional-dependencies", {}).values():
            self.extras |= {requirement_name(r) for r in requirements}


def projects() -> list[Project]:
    folders = [ROOT, *sorted(p.parent for p in ROOT.glob("packages/*/pyproject.toml"))]
    return [Project(f, tomllib.loads((f / "pyproject.toml").read_text())) for f in folders]


@dataclass
class Imports:
    """What one distribution's sources import: top-level module -> first file:line, split into
    required (a plain import) and optional (guarded or probed), plus numpy's implicit users."""

    required: dict[str, str] = field(default_factory=dict)
    optional: dict[str, str] = field(default_factory=dict)
    numpy_users: list[str] = field(default_factory=list)


def _catches_import_error(node: ast.Try) -> bool:
    """Whether a handler of ``node`` catches ImportError (or its ModuleNotFoundError)."""
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names = {t.id for t in types if isinstance(t, ast.Name)}
        if names & {"ImportError", "ModuleNotFoundError"}:
            return True
    return False


def _string_argument(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def scan(project: Project) -> Imports:
    found = Imports()
    source = project.folder / "src" / project.module
    for path in sorted(source.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
        guarded: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and _catches_import_error(node):
                for child in [*node.body, *node.handlers]:
                    guarded |= {id(n) for n in ast.walk(child)}
        for node in ast.walk(tree):
            modules: list[str] = []
            optional = id(node) in guarded
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                imported = {alias.name for alias in node.names}
                if node.module == "safetensors.torch" and imported & _SAFETENSORS_NUMPY:
                    found.numpy_users.append(f"{where}:{node.lineno} (safetensors.torch.save*)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "numpy" and not node.args:
                    found.numpy_users.append(f"{where}:{node.lineno} (Tensor.numpy())")
                name = _string_argument(node)
                if name and node.func.attr == "import_module":
                    modules = [name]
                elif name and node.func.attr == "find_spec":
                    modules, optional = [name], True
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names:
                    continue
                target = found.optional if optional else found.required
                target.setdefault(top, f"{where}:{node.lineno}")
    return found


def check_imports(project: Project, siblings: dict[str, str]) -> list[str]:
    problems = []
    found = scan(project)
    own = {project.module}
    for module, where in sorted(found.required.items()):
        if module in own:
            continue
        dist = siblings.get(module) or IMPORT_TO_DIST.get(module)
        if dist is None:
            problems.append(
                f"{project.name}: imports {module!r} ({where}), which IMPORT_TO_DIST does not map "
                "to a distribution"
            )
        elif (project.name, module) in UNDECLARED:
            continue
        elif normalize(dist) not in project.base | project.extras:
            problems.append(
                f"{project.name}: imports {module!r} ({where}) but declares no {dist!r} "
                "(dependencies or an extra)"
            )
    if found.numpy_users and "numpy" not in project.base:
        problems.append(
            f"{project.name}: {found.numpy_users[0]} needs numpy, not in its dependencies"
        )
    return problems


def relative_links(text: str) -> list[str]:
    links = _LINK.findall(text) + _REFERENCE.findall(text) + _HTML.findall(text)
    return [link for link in links if not _ABSOLUTE.match(link)]


def check_sources(all_projects: list[Project]) -> list[str]:
    problems: list[str] = []
    siblings = {p.module: p.name for p in all_projects}
    license_text = (ROOT / "LICENSE").read_bytes() if (ROOT / "LICENSE").is_file() else b""
    if "Apache License" not in license_text[:200].decode(errors="replace"):
        problems.append("LICENSE: missing at the repository root, or not the Apache-2.0 text")
    floors = {p.pyproject["project"].get("requires-python") for p in all_projects}
    if len(floors) != 1:
        problems.append(f"requires-python differs between projects: {sorted(map(str, floors))}")
    for project in all_projects:
        meta = project.pyproject["project"]
        problems += check_imports(project, siblings)
        if meta.get("license") != "Apache-2.0" or meta.get("license-files") != ["LICENSE"]:
            problems.append(
                f"{project.name}: license must be 'Apache-2.0', license-files ['LICENSE']"
            )
        copy = project.folder / "LICENSE"
        if not copy.is_file() or copy.read_bytes() != license_text:
            problems.append(f"{project.name}: {copy.relative_to(ROOT)} is not the root LICENSE")
        for key in ("classifiers", "urls"):
            if not meta.get(key):
                problems.append(f"{project.name}: no [project] {key}")
        readme = project.folder / meta["readme"]
        for link in relative_links(readme.read_text(encoding="utf-8")):
            problems.append(
                f"{readme.relative_to(ROOT)}: relative link {link!r} is dead on the index page"
            )
    return problems


def check_dist(dist: Path, all_projects: list[Project]) -> list[str]:
    problems: list[str] = []
    license_text = (ROOT / "LICENSE").read_bytes()
    for project in all_projects:
        stem = project.name.replace("-", "_")
        version = project.pyproject["project"]["version"]
        wheel = dist / f"{stem}-{version}-py3-none-any.whl"
        sdist = dist / f"{stem}-{version}.tar.gz"
        if not wheel.is_file() or not sdist.is_file():
            problems.append(f"{project.name}: {wheel.name} or {sdist.name} not built in {dist}")
            continue
        with zipfile.ZipFile(wheel) as archive:
            info = f"{stem}-{version}.dist-info"
            metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
            try:
                shipped = archive.read(f"{info}/licenses/LICENSE")
            except KeyError:
                shipped = b""
        if shipped != license_text:
            problems.append(f"{wheel.name}: {info}/licenses/LICENSE missing or not the LICENSE")
        expected = {
            "License-Expression": "Apache-2.0",
            "License-File": "LICENSE",
            "Requires-Python": project.pyproject["project"]["requires-python"],
        }
        for key, value in expected.items():
            if metadata.get(key) != value:
                problems.append(f"{wheel.name}: {key} is {metadata.get(key)!r}, not {value!r}")
        for key in ("Classifier", "Project-URL"):
            if not metadata.get_all(key):
                problems.append(f"{wheel.name}: no {key} in METADATA")
        for link in relative_links(metadata.get_payload()):
            problems.append(f"{wheel.name}: the description's link {link!r} is relative")
        with tarfile.open(sdist) as archive:
            if f"{stem}-{version}/LICENSE" not in archive.getnames():
                problems.append(f"{sdist.name}: no LICENSE")
    return problems


def main(argv: list[str]) -> int:
    all_projects = projects()
    problems = check_sources(all_projects)
    if argv:
        problems += check_dist(Path(argv[0]), all_projects)
    for problem in problems:
        print(problem)
    names = ", ".join(p.name for p in all_projects)
    print(f"check_release: {len(problems)} problem(s) in {len(all_projects)} projects ({names})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
