"""What each command builds, the build pipeline's order and memory gate (with fakes: no Go, no
processes), the timing record, the progress line and the ``go build`` command lines."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack import binaries
from hack.binaries import Component, Pipeline

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3


def names(components: tuple[Component, ...] | list[Component]) -> list[str]:
    return [c.name for c in components]


def binaries_called(*paths: Path) -> set[str]:
    """Every binary named by a ``binary("...")`` call in those files (or trees)."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    found: set[str] = set()
    for file in files:
        found |= set(re.findall(r"""\bbinary\(\s*["']([a-z0-9-]+)["']""", file.read_text()))
    return found


def component_of(binary: str) -> str:
    return next(c.name for c in binaries.COMPONENTS if binary in c.binaries)


# --- the sets ---------------------------------------------------------------------------------

def test_run_builds_the_cluster_headscale_and_nothing_the_operator_never_starts() -> None:
    assert names(binaries.set_components("run", node=True)) == [
        "etcd", "kubernetes", "headscale", "containerd", "runc", "cni-plugins", "coredns"]
    assert names(binaries.set_components("run", node=False)) == ["etcd", "kubernetes", "headscale"]


def test_run_covers_every_binary_make_run_starts() -> None:
    localenv = REPO / "hack" / "localenv"
    started = binaries_called(localenv / "__main__.py", localenv / "controlplane.py", localenv / "node.py",
                              localenv / "headscale.py", REPO / "hack" / "image.py")
    # image.py's router, benchmark and conformance images: not make run's
    started -= {"tailscaled", "tailscale", "echo-basic"}
    assert started, "no binary(...) call found: the scan is broken"
    assert {component_of(b) for b in started} <= set(names(binaries.set_components("run", node=True)))


def test_test_covers_every_binary_the_suite_and_the_tooling_start() -> None:
    used = binaries_called(REPO / "e2e", REPO / "hack", REPO / "benchmarks") - {"kind"}  # kind: make e2e only
    test_set = set(names(binaries.set_components("test", node=True)))
    assert {component_of(b) for b in used} <= test_set
    assert "kind" not in test_set
    assert set(names(binaries.set_components("test", node=False))) == test_set - {
        "containerd", "runc", "cni-plugins", "coredns"}


def test_the_other_commands_add_theirs() -> None:
    run = set(names(binaries.set_components("run", node=True)))
    assert set(names(binaries.set_components("bench", node=True))) == run | {"tailscale"}
    assert names(binaries.set_components("interop", node=True)) == ["etcd", "kubernetes", "headscale", "tailscale"]
    e2e = set(names(binaries.set_components("e2e", node=False)))
    assert {"kind", "kubernetes", "helm", "coredns", "tailscale"} <= e2e
    assert {"kubeadm", "containerd", "runc", "cni-plugins", "cni-ptp"} <= e2e, "kind's node image, built here"
    assert names(binaries.set_components("all", node=False)) == names(binaries.COMPONENTS)
    with pytest.raises(KeyError, match="unknown set"):
        binaries.set_components("everything", node=True)


def test_sets_follow_the_interop_version_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILNET_TAILSCALE_VERSION", "1.80.3")
    chosen = {c.name: c.version for c in binaries.set_components("interop", node=False)}
    assert chosen["tailscale"] == "1.80.3" and chosen["headscale"] == binaries.HEADSCALE.version


def test_the_node_is_expected_for_root_unless_turned_off() -> None:
    assert binaries.node_expected({}, euid=0)
    assert not binaries.node_expected({"TAILNET_LOCALENV_NODE": "0"}, euid=0)
    assert not binaries.node_expected({}, euid=1000)


def test_build_arguments_name_sets_and_components(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILNET_HEADSCALE_VERSION", raising=False)
    monkeypatch.setattr(binaries, "node_expected", lambda: False)
    request = binaries._parse_build(["--set", "interop", "--jobs=1", "headscale@0.26.1"])
    assert [c.key for c in request.components][-1] == "headscale-0.26.1" and request.jobs == 1
    assert names(request.components)[:4] == ["etcd", "kubernetes", "headscale", "tailscale"]
    assert not request.in_order
    assert binaries._parse_build([]) == binaries.BuildRequest(list(binaries.COMPONENTS))
    assert names(binaries._parse_build(["kind"]).components) == ["kind"]
    assert binaries._parse_build(["--in-order", "kind", "etcd"]).in_order
    for bad in (["--jobs", "0"], ["--set"], ["--fast"], ["--set=nope"]):
        with pytest.raises(KeyError):
            binaries._parse_build(bad)


def test_build_command_takes_a_set_and_reports_failures(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(binaries, "node_expected", lambda: True)
    seen: list[tuple[list[str], int | None, bool]] = []

    def fake_build_all(components: list[Component], *, jobs: int | None = None,
                       in_order: bool = False) -> list[binaries.Failure]:
        seen.append((names(components), jobs, in_order))
        return [binaries.Failure(binaries.RUNC, "go build failed:\nno seccomp.h")] if jobs == 1 else []

    monkeypatch.setattr(binaries, "build_all", fake_build_all)
    assert binaries.main(["build", "--set", "run"]) == 0
    assert seen[-1] == (names(binaries.set_components("run", node=True)), None, False)
    assert binaries.main(["build", "--in-order", "--set", "test"]) == 0
    assert seen[-1] == (names(binaries.set_components("test", node=True)), None, True)
    assert "all binaries ready" in capsys.readouterr().err
    assert binaries.main(["build", "--jobs", "1", "runc"]) == 1
    assert "no seccomp.h" in capsys.readouterr().err
    assert binaries.main(["build", "--set", "nope"]) == 2


def test_nothing_to_build_needs_no_go(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for b in binaries.ETCD.binaries:
        binaries.ETCD.directory.mkdir(parents=True, exist_ok=True)
        binaries.ETCD.path(b).write_text("")
    monkeypatch.setattr(binaries, "require_go", lambda: pytest.fail("Go was asked for"))
    assert binaries.build_all([binaries.ETCD, binaries.ETCD]) == []
    assert binaries.build(binaries.ETCD) == 0.0


# --- timings and the progress line ------------------------------------------------------------

def test_timings_are_recorded_per_version_and_estimate_the_next_build(tmp_path: Path) -> None:
    path = tmp_path / "bin" / ".timings.json"
    assert binaries.load_timings(path) == {}
    old = binaries.at_version(binaries.TAILSCALE, "1.80.3")
    binaries.record_timing(old, 301.26, path=path, now=dt.datetime(2025, 1, 1, tzinfo=dt.UTC))
    binaries.record_timing(binaries.KUBERNETES, 650, beside=1, path=path, now=dt.datetime(2025, 1, 2, tzinfo=dt.UTC))
    timings = binaries.load_timings(path)
    assert timings["kubernetes-1.36.3"] == {"seconds": 650, "finished": "2025-01-02T00:00:00Z", "beside": 1}
    assert binaries.last_build(binaries.KUBERNETES, timings) == 650
    # Another version of the component stands in until this one is built.
    assert binaries.last_build(binaries.TAILSCALE, timings) == 301.3
    assert binaries.last_build(binaries.HELM, timings) is None
    assert binaries.estimate(binaries.HELM, timings) == binaries.TYPICAL_SECONDS["helm"]
    path.write_text("{not json")
    assert binaries.load_timings(path) == {}
    path.write_text(json.dumps(["a list"]))
    assert binaries.load_timings(path) == {}


def test_every_component_has_a_typical_duration() -> None:
    assert set(binaries.TYPICAL_SECONDS) == {c.name for c in binaries.COMPONENTS}


def test_in_order_builds_start_in_the_order_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(binaries, "require_go", lambda: "go")
    started: list[list[str]] = []

    class Recorder:
        def __init__(self, order: list[Component], *args: object, **kwargs: object) -> None:
            started.append(names(order))

        def run(self) -> list[binaries.Failure]:
            return []

    monkeypatch.setattr(binaries, "Pipeline", Recorder)
    wanted = [binaries.HEADSCALE, binaries.KIND, binaries.KUBERNETES]
    binaries.build_all(wanted, in_order=True)
    binaries.build_all(wanted)
    assert started == [["headscale", "kind", "kubernetes"], ["kubernetes", "headscale", "kind"]]


def test_the_suite_gets_its_first_binaries_first() -> None:
    """The test set starts with what the first integration tests start (Headscale, tailscaled)
    beside Kubernetes, and ends with what only a few tests use."""
    order = names(binaries.SETS["test"])
    assert order[:3] == ["kubernetes", "headscale", "tailscale"]
    assert order.index("etcd") < order.index("containerd") < order.index("helm")


def test_a_wait_for_a_build_runs_inside_the_wait_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    events: list[str] = []

    def fake_build(component: Component) -> float:
        events.append(f"build {component.name}")
        for b in component.binaries:
            component.directory.mkdir(parents=True, exist_ok=True)
            component.path(b).write_text("")
        return 1.0

    @contextlib.contextmanager
    def hook() -> Iterator[None]:
        events.append("paused")
        yield
        events.append("resumed")

    monkeypatch.setattr(binaries, "build", fake_build)
    monkeypatch.setattr(binaries, "_wait_hook", contextlib.nullcontext)
    binaries.set_wait_hook(hook)
    assert binaries.binary("etcd") == binaries.ETCD.path("etcd")
    assert binaries.binary("etcd") == binaries.ETCD.path("etcd")  # cached: no build, no pause
    assert events == ["paused", "build etcd", "resumed"]


def test_longest_builds_start_first() -> None:
    timings: dict[str, dict[str, float | str | int]] = {"runc-1.3.3": {"seconds": 900.0, "finished": "x"}}
    order = binaries.longest_first([binaries.KIND, binaries.HEADSCALE, binaries.KUBERNETES, binaries.RUNC], timings)
    assert names(order) == ["runc", "kubernetes", "headscale", "kind"]


def test_the_progress_line_says_what_is_built_its_last_time_and_what_is_left() -> None:
    line = binaries.progress_line("building", binaries.KUBERNETES, position=2, total=5, last=652.0, typical=689,
                                  left=[binaries.COREDNS, binaries.at_version(binaries.HEADSCALE, "0.26.1")],
                                  left_seconds=520)
    assert line == ("binaries [2/5] building kubernetes 1.36.3 (last build 11 min); "
                    "left: coredns, headscale-0.26.1 (~9 min of building)")
    line = binaries.progress_line("built", binaries.RUNC, position=5, total=5, last=None, typical=32, left=[],
                                  left_seconds=0, took=41)
    assert line == "binaries [5/5] built runc 1.3.3 in 41s (no build recorded, typically 32s); nothing left after it"


# --- the memory gate and the pipeline ---------------------------------------------------------

def test_a_second_compile_needs_the_memory_and_a_free_slot() -> None:
    assert binaries.may_start(0, 2, 1 * GIB)  # one compile always runs
    assert not binaries.may_start(1, 2, 5 * GIB)
    assert binaries.may_start(1, 2, 6 * GIB)
    assert binaries.may_start(1, 2, None)  # the kernel does not tell: no limit
    assert not binaries.may_start(2, 2, 64 * GIB)
    assert not binaries.may_start(1, 1, 64 * GIB)


def test_mem_available_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   24029664 kB\n")
    assert binaries.mem_available(meminfo) == 24029664 * 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert binaries.mem_available(meminfo) is None
    assert binaries.mem_available(tmp_path / "absent") is None


def test_jobs_default_to_two_and_follow_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILNET_BUILD_JOBS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert binaries.default_jobs() == 2
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert binaries.default_jobs() == 1
    monkeypatch.setenv("TAILNET_BUILD_JOBS", "3")
    assert binaries.default_jobs() == 3


class Fakes:
    """prepare/compile stand-ins that record what the pipeline asked for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prepared: list[str] = []
        self.compiled: list[str] = []
        self.running = 0
        self.most_running = 0

    def prepare(self, component: Component) -> str | None:
        with self.lock:
            self.prepared.append(component.name)
        return component.name

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)

    def leave(self, name: str) -> None:
        with self.lock:
            self.running -= 1
            self.compiled.append(name)

    def compile(self, component: Component, prepared: str, beside: int) -> None:
        self.enter()
        self.leave(prepared)


def pipeline(fakes: Fakes, components: list[Component], **kwargs: object) -> tuple[Pipeline[str], list[str]]:
    lines: list[str] = []
    made: Pipeline[str] = Pipeline(components, fakes.prepare, fakes.compile, report=lines.append,
                                   **kwargs)  # type: ignore[arg-type]
    return made, lines


def test_pipeline_compiles_in_the_given_order_and_reports_each() -> None:
    fakes = Fakes()
    made, lines = pipeline(fakes, [binaries.KUBERNETES, binaries.HEADSCALE, binaries.RUNC], jobs=1)
    assert made.run() == []
    assert fakes.compiled == ["kubernetes", "headscale", "runc"] == [k.split("-")[0] for k in made.started]
    assert fakes.most_running == 1
    assert lines[0].startswith("binaries [1/3] building kubernetes") and "left: headscale, runc" in lines[0]
    assert any(line.startswith("binaries [3/3] built runc") and "nothing left" in line for line in lines)


def test_cached_and_failing_components_do_not_stop_the_others() -> None:
    fakes = Fakes()

    def prepare(component: Component) -> str | None:
        if component is binaries.ETCD:
            return None  # another process built it meanwhile
        if component is binaries.HELM:
            raise RuntimeError("go get helm.sh/helm/v3@v3.22.0 failed:\n410 Gone")
        return component.name

    def compile(component: Component, prepared: str, beside: int) -> None:
        if prepared == "runc":
            raise RuntimeError("go build failed:\nseccomp.h: No such file")
        fakes.compile(component, prepared, beside)

    lines: list[str] = []
    made: Pipeline[str] = Pipeline([binaries.ETCD, binaries.HELM, binaries.RUNC, binaries.KIND], prepare, compile,
                                   jobs=2, available=lambda: 64 * GIB, report=lines.append)
    failures = made.run()
    assert sorted(f.component.name for f in failures) == ["helm", "runc"]
    assert fakes.compiled == ["kind"]
    assert any("cached etcd" in line for line in lines)
    assert any("helm 3.22.0 FAILED: 410 Gone" in line for line in lines)
    assert any("runc 1.3.3 FAILED: seccomp.h: No such file" in line for line in lines)


def test_a_component_another_process_builds_is_passed_over_then_found_built() -> None:
    fakes = Fakes()
    tries: list[str] = []

    def claim(component: Component) -> binaries.Claim | None:
        tries.append(component.name)
        if component is binaries.KUBERNETES:
            if "etcd" not in fakes.compiled or "kind" not in fakes.compiled:
                raise binaries.Busy(component.key)  # another process is compiling it
            return None  # and has built it by now
        return binaries._Unlocked()

    discarded: list[str] = []
    lines: list[str] = []
    made: Pipeline[str] = Pipeline([binaries.KUBERNETES, binaries.ETCD, binaries.KIND], fakes.prepare, fakes.compile,
                                   claim=claim, discard=discarded.append, jobs=1, poll=0.01, report=lines.append)
    assert made.run() == []
    assert fakes.prepared == ["kubernetes", "etcd", "kind"]
    assert fakes.compiled == ["etcd", "kind"]
    assert tries[0] == "kubernetes" and tries[-1] == "kubernetes"
    assert discarded == ["kubernetes"]
    assert any("cached kubernetes" in line for line in lines)


def test_a_claim_is_released_when_its_compile_ends_even_when_it_fails() -> None:
    released: list[str] = []

    class Held:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            released.append(self.name)

    def compile(component: Component, prepared: str, beside: int) -> None:
        assert released == ([] if component is binaries.ETCD else ["etcd"])
        if component is binaries.KIND:
            raise RuntimeError("go build failed")

    made: Pipeline[str] = Pipeline([binaries.ETCD, binaries.KIND], lambda c: c.name, compile,
                                   claim=lambda c: Held(c.name), jobs=1, report=lambda line: None)
    assert [f.component.name for f in made.run()] == ["kind"]
    assert released == ["etcd", "kind"]


def test_two_compiles_run_at_once_when_memory_allows() -> None:
    fakes = Fakes()
    both = threading.Barrier(2, timeout=30)

    def compile(component: Component, prepared: str, beside: int) -> None:
        fakes.enter()
        both.wait()  # passes only when the other compile runs at the same time
        fakes.leave(prepared)

    made: Pipeline[str] = Pipeline([binaries.KUBERNETES, binaries.HEADSCALE], fakes.prepare, compile, jobs=2,
                                   available=lambda: 8 * GIB, report=lambda line: None)
    assert made.run() == []
    assert fakes.most_running == 2


def test_no_second_compile_while_memory_is_short() -> None:
    fakes = Fakes()
    asked = threading.Event()

    def available() -> int:
        asked.set()  # the pipeline considered a second compile beside the first
        return 2 * GIB

    def compile(component: Component, prepared: str, beside: int) -> None:
        fakes.enter()
        if prepared == "kubernetes":
            assert asked.wait(30), "the pipeline never considered the second compile"
        fakes.leave(prepared)

    made: Pipeline[str] = Pipeline([binaries.KUBERNETES, binaries.HEADSCALE, binaries.KIND], fakes.prepare, compile,
                                   jobs=2, available=available, report=lambda line: None)
    assert made.run() == []
    assert fakes.most_running == 1
    assert fakes.compiled == ["kubernetes", "headscale", "kind"]


# --- the go build command lines ---------------------------------------------------------------

def test_binaries_named_after_their_packages_build_in_one_go_build(tmp_path: Path) -> None:
    [cmd] = binaries.build_commands("go", binaries.KUBERNETES, tmp_path, "-s -w")
    assert cmd[:2] == ["go", "build"] and "-gcflags=all=-dwarf=false" in cmd
    assert cmd[cmd.index("-o") + 1] == f"{tmp_path}/"
    assert cmd[-6:] == list(binaries.KUBERNETES.packages)
    [prom] = binaries.build_commands("go", binaries.PROMETHEUS, tmp_path, "-s -w")
    assert prom[prom.index("-tags") + 1] == "remove_all_sd"


def test_other_binaries_build_one_by_one_under_their_own_names(tmp_path: Path) -> None:
    [etcd] = binaries.build_commands("go", binaries.ETCD, tmp_path, "-s -w")
    assert etcd[etcd.index("-o") + 1:] == [str(tmp_path / "etcd"), "go.etcd.io/etcd/server/v3"]
    [runc] = binaries.build_commands("go", binaries.RUNC, tmp_path, "-s -w")
    assert runc[runc.index("-tags") + 1] == "seccomp urfave_cli_no_docs"


def test_the_default_binary_name_skips_a_major_version_suffix() -> None:
    assert binaries.default_binary_name("go.etcd.io/etcd/server/v3") == "server"
    assert binaries.default_binary_name("github.com/containerd/containerd/v2/cmd/ctr") == "ctr"
    assert binaries.default_binary_name("tailscale.com/cmd/tailscaled") == "tailscaled"


def test_kubernetes_carries_its_version_in_the_ldflags() -> None:
    flags = binaries.ldflags(binaries.KUBERNETES)
    assert "-X k8s.io/component-base/version.gitVersion=v1.36.3" in flags and flags.startswith("-s -w")
    assert binaries.ldflags(binaries.HELM) == "-s -w -X helm.sh/helm/v3/internal/version.version=v3.22.0"
    assert binaries.ldflags(binaries.ETCD) == "-s -w"


def test_coredns_drops_only_the_named_plugins() -> None:
    zplugin = ('// generated by directives_generate.go; DO NOT EDIT\n\npackage plugin\n\nimport (\n'
               '\t// Include all plugins.\n'
               '\t_ "github.com/coredns/coredns/plugin/route53"\n'
               '\t_ "github.com/coredns/coredns/plugin/kubernetes"\n'
               '\t_ "github.com/coredns/coredns/plugin/etcd"\n'
               '\t_ "github.com/coredns/coredns/plugin/file"\n'
               '\t_ "github.com/coredns/coredns/plugin/trace"\n)\n')
    trimmed = binaries.without_plugins(zplugin, "github.com/coredns/coredns", binaries.COREDNS_DROPPED_PLUGINS)
    assert "route53" not in trimmed and '/plugin/etcd"' not in trimmed and "plugin/trace" not in trimmed
    assert '\t_ "github.com/coredns/coredns/plugin/kubernetes"\n' in trimmed and "plugin/file" in trimmed
    assert trimmed.endswith(")\n") and trimmed.startswith("// generated")


def directives(corefile: str) -> set[str]:
    return {line.split()[0] for line in corefile.splitlines() if line.startswith("    ") and line.strip() != "}"}


def test_the_node_and_gateway_corefiles_use_no_dropped_plugin() -> None:
    from hack.localenv import node
    from tailnet_operator.resources import gateway

    used = directives(node.COREFILE) | directives(gateway.corefile("corp.example"))
    assert {"kubernetes", "hosts", "file"} <= used
    assert not used & set(binaries.COREDNS_DROPPED_PLUGINS)


def test_the_progress_line_gives_the_whole_build_time_the_compile_reports() -> None:
    lines: list[str] = []
    made: Pipeline[str] = Pipeline([binaries.KIND], lambda c: c.name, lambda c, p, beside: 42.0,
                                   report=lines.append)
    assert made.run() == []
    assert lines[-1].startswith("binaries [1/1] built kind 0.33.0 in 42s")


def test_a_locked_component_is_busy_and_a_built_one_needs_no_claim_or_preparation(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import fcntl

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(binaries, "require_go", lambda: pytest.fail("Go was asked for"))
    lock_path = binaries.cache_root() / ".build-kind-0.33.0.lock"
    binaries.cache_root().mkdir(parents=True)
    with lock_path.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another builder holds it
        with pytest.raises(binaries.Busy):
            binaries.claim(binaries.KIND)
    claimed = binaries.claim(binaries.KIND)
    assert claimed is not None
    claimed.close()
    binaries.KIND.directory.mkdir(parents=True)
    binaries.KIND.path("kind").write_text("")
    assert binaries.claim(binaries.KIND) is None
    assert binaries.prepare(binaries.KIND) is None


def test_a_builder_locks_a_component_only_while_it_compiles_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """Two builders share the machine (CI's background one at one compile at a time beside
    ``make test``'s): while one compiles Kubernetes, the Headscale it has prepared must stay free
    for the other to take, or the first tests wait for both compiles in a row."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(binaries, "require_go", lambda: "go")
    monkeypatch.setattr(binaries, "record_timing", lambda *args, **kwargs: None)
    monkeypatch.setattr(binaries, "_set_up", lambda go, component, work: work)
    free_while_kubernetes_compiled: list[bool] = []

    def fake_go(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        if cmd[1] != "build":
            return ""  # go list -deps: the downloads
        if "k8s.io/kubernetes/cmd/kubelet" in cmd:
            other = binaries._lock(binaries.HEADSCALE, wait=False)  # what another process would try
            free_while_kubernetes_compiled.append(other is not None)
            if other is not None:
                other.close()
        target = cmd[cmd.index("-o") + 1]
        if target.endswith("/"):  # one go build for every binary of the component
            for package in cmd[cmd.index("-o") + 2:]:
                (Path(target) / binaries.default_binary_name(package)).write_text("")
        else:
            Path(target).write_text("")
        return ""

    monkeypatch.setattr(binaries, "_run", fake_go)
    assert binaries.build_all([binaries.KUBERNETES, binaries.HEADSCALE], jobs=1, in_order=True) == []
    assert free_while_kubernetes_compiled == [True]
    assert binaries.KUBERNETES.is_built() and binaries.HEADSCALE.is_built()
