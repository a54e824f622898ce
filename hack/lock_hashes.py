"""Write the sha256 of every pinned distribution into the locks (``--hash=`` lines).

pip then installs with ``--require-hashes``: a package whose file differs from the one locked
(a registry or mirror serving something else under the same version) stops the install. The
hashes are of the files pip downloads for this platform and Python (the image's are the same:
CPython 3.11 on x86_64 Linux). Two locks:

* ``requirements.lock``: every pin (the runtime, the test tools), for the development venv;
* ``requirements-image.lock``: the runtime dependencies of pyproject.toml and what they need,
  plus the build backend, for the image (which ships no test tools).

Run it after changing a pin (pip resolves what the runtime and the backend need, constrained
to the lock's versions):

    .venv/bin/python -m hack.lock_hashes
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
IMAGE_LOCK = ROOT / "requirements-image.lock"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name_and_version(filename: str) -> tuple[str, str]:
    """The project name (as spelled in the file name) and version of a wheel or sdist file."""
    stem = filename.removesuffix(".whl").removesuffix(".tar.gz").removesuffix(".zip")
    name, version = stem.split("-")[:2]
    return name, version


def _distribution_name(filename: str) -> str:
    """The normalized project name of a wheel or sdist file name."""
    return _normalized(_name_and_version(filename)[0])


def pins(text: str) -> list[str]:
    """The ``name==version`` lines of a lock, with any hash continuation lines dropped."""
    return [line.split(" ")[0].rstrip("\\").strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith(("#", "--hash"))]


def render(requirements: list[str], hashes: dict[str, list[str]]) -> str:
    """The lock text: each pin followed by its files' hashes."""
    out = []
    for requirement in requirements:
        name = _normalized(requirement.split("==")[0])
        digests = sorted(hashes.get(name) or [])
        if not digests:
            raise SystemExit(f"no file was downloaded for {requirement}")
        out.append(" \\\n".join([requirement, *(f"    --hash=sha256:{d}" for d in digests)]))
    return "\n".join(out) + "\n"


def _download(requirements: list[str], directory: Path, *, constraints: Path | None = None) -> dict[str, str]:
    """pip-download ``requirements`` (with their dependencies when ``constraints`` pins them) into
    ``directory``; ``{normalized name: "name==version"}`` of every file there, and its hash."""
    deps = ["-c", str(constraints)] if constraints is not None else ["--no-deps"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", *deps, "-d", str(directory), *requirements],
                   check=True)
    found = {}
    for path in directory.iterdir():
        name, version = _name_and_version(path.name)
        found[_normalized(name)] = f"{name}=={version}"
    return found


def _file_hashes(directory: Path) -> dict[str, list[str]]:
    hashes: dict[str, list[str]] = {}
    for path in directory.iterdir():
        hashes.setdefault(_distribution_name(path.name), []).append(hashlib.sha256(path.read_bytes()).hexdigest())
    return hashes


def main() -> int:
    requirements = pins(LOCK.read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    with tempfile.TemporaryDirectory(prefix="lock-") as tmp:
        everything, image_files, constraints = Path(tmp) / "all", Path(tmp) / "image", Path(tmp) / "pins.txt"
        constraints.write_text("\n".join(requirements) + "\n")
        _download(requirements, everything)
        # the runtime and the build backend with what they need, at the lock's versions
        image = sorted(_download(roots, image_files, constraints=constraints).values(), key=str.lower)
        hashes = {**_file_hashes(everything), **_file_hashes(image_files)}
    LOCK.write_text(render(requirements, hashes))
    IMAGE_LOCK.write_text(render(image, hashes))
    print(f"wrote {len(requirements)} pins to {LOCK.name} and {len(image)} to {IMAGE_LOCK.name}, with hashes",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
