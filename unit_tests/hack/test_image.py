"""The image builder's pure logic: which files make a tag, names, mirrors, archives, pruning."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
import time
from pathlib import Path, PurePosixPath

import pytest

from hack import image

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _project(tmp_path: Path) -> Path:
    files = {name: name for name in image.PROJECT_FILES}
    files |= {"tailnet_operator/__init__.py": "x = 1\n", "tailnet_agent/__main__.py": "y = 2\n",
              "native/src/lib.rs": "fn main() {}\n"}
    return _tree(tmp_path, files)


def _hash(root: Path) -> str:
    return image.content_hash(root, image.project_inputs(root), {"base": "sha256:1"})


def test_hash_changes_when_a_source_changes(tmp_path: Path) -> None:
    root = _project(tmp_path)
    before = _hash(root)
    (root / "tailnet_operator/__init__.py").write_text("x = 2\n")
    assert _hash(root) != before


def test_hash_changes_when_a_source_is_added_or_renamed(tmp_path: Path) -> None:
    root = _project(tmp_path)
    before = _hash(root)
    (root / "tailnet_agent/new.py").write_text("")
    added = _hash(root)
    (root / "tailnet_agent/new.py").rename(root / "tailnet_agent/other.py")
    assert len({before, added, _hash(root)}) == 3


@pytest.mark.parametrize("ignored", [
    "tailnet_operator/__pycache__/__init__.cpython-311.pyc",
    "tailnet_agent/_native.abi3.so",
    "tailnet_agent/module.py~",
    "tailnet_operator.egg-info/PKG-INFO",
    "native/target/release/lib_native.so",
    "native/target/release/build/out.rs",
    ".venv/lib/site.py",
    "docs/development.md",
])
def test_hash_ignores_build_outputs_and_files_not_copied(tmp_path: Path, ignored: str) -> None:
    root = _project(tmp_path)
    before = _hash(root)
    _tree(root, {ignored: "anything"})
    assert _hash(root) == before


def test_hash_covers_the_executable_bit_and_the_extras(tmp_path: Path) -> None:
    root = _project(tmp_path)
    files = image.project_inputs(root)
    before = image.content_hash(root, files, {"base": "a"})
    assert image.content_hash(root, files, {"base": "b"}) != before
    (root / "tailnet_agent/__main__.py").chmod(0o755)
    assert image.content_hash(root, files, {"base": "a"}) != before


def test_is_ignored() -> None:
    assert image.is_ignored(PurePosixPath("tailnet_agent/__pycache__/x.pyc"))
    assert image.is_ignored(PurePosixPath("native/src/target/x.rs"))
    assert not image.is_ignored(PurePosixPath("tailnet_agent/targets.py"))
    assert not image.is_ignored(PurePosixPath("tailnet_agent/_native.pyi"))


def test_the_hashed_inputs_are_what_the_containerfile_copies() -> None:
    """Every COPY source of the real Containerfile is hashed (or is the host-built extension)."""
    sources: set[str] = set()
    for line in (REPO / "Containerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources.update(line.split()[1:-1])
    hashed = set(image.PROJECT_FILES) | set(image.PROJECT_TREES) | {image.NATIVE_IN_CONTEXT}
    assert sources - {"Containerfile"} <= hashed
    assert hashed - {"Containerfile"} <= sources


def test_the_containerfile_defaults_to_public_images_and_runs_as_nonroot() -> None:
    text = (REPO / "Containerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.MULTILINE))
    assert args["BASE"].startswith("docker.io/") and args["RUST"].startswith("docker.io/")
    assert args["NATIVE"] == "cargo"
    final = text.rsplit("\nFROM ", 1)[1]
    assert f"USER {image.NONROOT}" in final


def test_base_tag_depends_on_suite_and_package_set_not_order() -> None:
    tag = image.base_tag("bookworm", ["python3", "ca-certificates"])
    assert tag.startswith("bookworm-")
    assert tag == image.base_tag("bookworm", ["ca-certificates", "python3"])
    assert tag != image.base_tag("bookworm", ["python3"])
    assert tag != image.base_tag("trixie", ["python3", "ca-certificates"])
    assert tag != image.base_tag("bookworm", ["python3", "ca-certificates"], trim=["usr/share/doc"])


def test_archive_path_is_named_after_the_ref(tmp_path: Path) -> None:
    assert image.archive_path("localhost/coredns:1.12.4", tmp_path) == tmp_path / "coredns-1.12.4.oci.tar"
    assert image.Image("localhost/tailnet-operator:abc", tmp_path).repository == image.PROJECT_REPOSITORY


def test_apt_mirror_from_deb822(tmp_path: Path) -> None:
    _tree(tmp_path, {"sources.list.d/debian.sources": (
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n")})
    assert image.apt_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    assert image.apt_mirror("bookworm-security", tmp_path) == "http://security.example/debian-security"


def test_apt_mirror_from_one_line_sources_and_default(tmp_path: Path) -> None:
    assert image.apt_mirror("bookworm", tmp_path) == image.DEFAULT_MIRROR
    _tree(tmp_path, {"sources.list": "# deb http://old.example/debian bookworm main\n"
                                     "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n"})
    assert image.apt_mirror("bookworm", tmp_path) == "http://one.example/debian"
    assert image.apt_mirror("trixie", tmp_path) == image.DEFAULT_MIRROR


def test_host_ca_bundle_prefers_pips_then_openssls_variable(tmp_path: Path) -> None:
    pip, ssl = _tree(tmp_path, {"pip.pem": "p"}) / "pip.pem", tmp_path / "ssl.pem"
    ssl.write_text("s")
    assert image.host_ca_bundle({"PIP_CERT": str(pip), "SSL_CERT_FILE": str(ssl)}) == str(pip)
    assert image.host_ca_bundle({"PIP_CERT": str(tmp_path / "absent"), "SSL_CERT_FILE": str(ssl)}) == str(ssl)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _archive(path: Path, ref: str, *, with_layer: bool = True) -> Path:
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w:gz") as inner:
        _add(inner, "pause", b"\x7fELF")
    config = json.dumps({"config": {"User": "65535:65535", "Entrypoint": ["/pause"]}}).encode()
    manifest = json.dumps({"config": {"digest": "sha256:c"}, "layers": [{"digest": "sha256:l"}]}).encode()
    index = {"manifests": [{"digest": "sha256:m", "annotations": {"org.opencontainers.image.ref.name": ref}}]}
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(index).encode())
        _add(tar, "blobs/sha256/m", manifest)
        _add(tar, "blobs/sha256/c", config)
        if with_layer:
            _add(tar, "blobs/sha256/l", layer.getvalue())
    return path


def test_read_archive_and_a_file_from_its_layers(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "a.oci.tar", "localhost/tailnet-pause:1")
    ref, config, layers = image.read_archive(archive)
    assert ref == "localhost/tailnet-pause:1"
    assert config["config"]["User"] == "65535:65535"
    assert layers == ["sha256:l"]
    assert image._file_from_archive(archive, "pause") == b"\x7fELF"


def test_read_archive_rejects_a_missing_layer(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "a.oci.tar", "localhost/x:1", with_layer=False)
    with pytest.raises(image.BuildError, match="absent"):
        image.read_archive(archive)


def test_stale_images_keep_the_kept_builds_layers_and_other_repositories() -> None:
    kept = {"localhost/tailnet-operator:new", "localhost/tailnet-operator:previous"}
    log = ("[4/5] STEP 2/9: WORKDIR /src\n--> Using cache aaaa1111bbbb2222cccc3333\n--> aaaa1111bbb\n"
           "[3/5] STEP 1/1: FROM dddd4444eeee AS native\n--> ffff5555000\n")
    listing = [
        ("ffff555500001111", "localhost/tailnet-operator:new"),
        ("9999888877776666", "localhost/tailnet-operator:old"),
        ("7777777777777777", "localhost/tailnet-operator:previous"),
        ("aaaa1111bbbb2222cccc3333", "<none>:<none>"),
        ("dddd4444eeee0000", "<none>:<none>"),
        ("1234123412341234", "<none>:<none>"),
        ("5555666677778888", "localhost/tailnet-base:bookworm-x"),
    ]
    stale = image.stale_images(listing, image.PROJECT_REPOSITORY, kept, log)
    assert stale == ["localhost/tailnet-operator:old", "1234123412341234"]


def test_parse_listing_strips_padding_and_the_digest_algorithm() -> None:
    listing = "sha256:ab12   |localhost/tailnet-operator:x  \nsha256:cd34|<none>:<none>\n\n"
    assert image.parse_listing(listing) == [("ab12", "localhost/tailnet-operator:x"), ("cd34", "<none>:<none>")]


def test_a_background_build_writes_its_output_to_its_log(tmp_path: Path) -> None:
    build = image.build_in_background(tmp_path / "logs" / "image-build.log", "no-such-image")
    assert build.wait(timeout=60) == 2
    assert "usage: python -m hack.image" in (tmp_path / "logs" / "image-build.log").read_text()


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of the group that still run (a zombie waiting for init to reap it is gone)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_stopping_a_background_build_ends_its_whole_process_group() -> None:
    build = subprocess.Popen(["sh", "-c", "sleep 60 & echo started; wait"], start_new_session=True,
                             stdout=subprocess.PIPE)
    assert build.stdout is not None and build.stdout.readline() == b"started\n"
    assert len(_alive_in_group(build.pid)) == 2
    image.stop_background(build, timeout=10)
    assert build.returncode is not None
    deadline = time.monotonic() + 10
    while _alive_in_group(build.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_in_group(build.pid) == [], "the sleep the build started is gone too"
