# The developer entry points. `make run` and `make test` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
OPERATOR ?= cluster

BINARY_SETS := run test bench interop chaos e2e

.PHONY: conformance e2e-multinode run test unit lint manifests binaries $(addprefix binaries-,$(BINARY_SETS)) native prereqs e2e bench fuzz \
        chaos interop clean help

help:
	@echo "make run        start the local cluster, install the operator in it, follow its logs (Ctrl-C stops)"
	@echo "                OPERATOR=source: run the operator from the source tree instead of the image"
	@echo "make test       lint, type-check and run every test against the real binaries"
	@echo "make unit       only the fast tests (no processes)"
	@echo "make manifests  regenerate manifests/crd from tailnet_operator/api"
	@echo "make binaries   build and cache every pinned binary (make binaries-run, -test, ...: one command's set)"
	@echo "make e2e        the end-to-end suite against a kind cluster (needs Docker)"
	@echo "make conformance the Gateway API's conformance suite, every declared feature, on the local node (report: docs/conformance/)"
	@echo "make fuzz       the fuzz targets at length: 10^6 inputs per Rust target, hypothesis at 2000 examples per property"
	@echo "make chaos      kills (operator leader, apiserver, etcd, Headscale, an agent, DERP) for CHAOS_ROUNDS rounds; CHAOS_SEED repeats one"
	@echo "make bench      egress (agent vs tailscaled, loopback, against a kernel-mode peer and in-cluster, with the kernel-mode proxy); ingress in-cluster vs the kernel-mode proxy; ingress vs tailscale serve; the cost of an HTTPRoute's rules; operator failover; runtime vs kopf vs controller-runtime; big cluster; policy; agent disruptions under load; the ingress name's hand-over between two nodes; the agent at 200 and 1,000 peers (docs/benchmarks.md)"
	@echo "make interop    the interop slice for every Headscale and tailscale version in range (docs/compatibility.md)"

prereqs:
	@hack/prereqs.sh

NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock $(wildcard native/src/*.rs)

$(VENV)/.installed: pyproject.toml requirements.lock | prereqs
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements.lock
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $@

# The agent's Rust core, built into tailnet_agent/_native.abi3.so.
$(VENV)/.native: $(VENV)/.installed $(NATIVE_SOURCES)
	@$(VENV)/bin/maturin develop --quiet --release -m native/Cargo.toml
	@touch $@

native: $(VENV)/.native

venv: $(VENV)/.installed

# Each command builds only the binaries it starts (the sets in hack/binaries.py), up to 2 at a time;
# anything else is built the moment something asks for it.
binaries: prereqs
	@$(PYTHON) -m hack.binaries build

$(addprefix binaries-,$(BINARY_SETS)): binaries-%: prereqs
	@$(PYTHON) -m hack.binaries build --set $*

lint: $(VENV)/.native
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/stubtest tailnet_agent._native --ignore-disjoint-bases --allowlist native/stubtest-allowlist.txt
	cd native && cargo clippy --quiet --release --all-targets -- -D warnings && cargo fmt --check

manifests: $(VENV)/.installed
	$(PY) -m hack.codegen
	$(PY) -m hack.render_install
	$(PY) -m hack.api_doc
	$(PY) -m hack.metrics_doc

unit: $(VENV)/.native
	$(VENV)/bin/pytest unit_tests -q $(PYTEST_ARGS)

# The test set builds in the background, at a lower priority and in the order the suite first needs
# it, while the virtualenv, lint, cargo test and the first tests run; a test that needs a binary not
# built yet waits for it (e2e/conftest.py runs the tests that need fewer binaries first). The last
# step waits for the whole set, so a failed build fails the command; an early exit stops the builds.
# The suite runs as two pytest processes side by side (hack/suite.py): the local node's tier beside
# everything else.
test: prereqs
	@set -m; nice -n 10 $(PYTHON) -m hack.binaries build --in-order --set test & builder=$$!; set +m; \
	trap 'kill -TERM -- -$$builder 2>/dev/null; true' EXIT; \
	$(MAKE) --no-print-directory lint && \
	(cd native && cargo test --quiet --release) && \
	$(PY) -m hack.suite $(PYTEST_ARGS) && \
	wait $$builder

# OPERATOR=source runs the operator from the source tree against the local cluster (no image build).
# The binaries build in the background from the start; the virtualenv is set up beside them, then
# hack.localenv starts the project's image build and waits for each binary as it needs it.
run: prereqs
	@set -m; $(PYTHON) -m hack.binaries build --set run & builder=$$!; set +m; \
	trap 'kill -TERM -- -$$builder 2>/dev/null; true' EXIT; \
	$(MAKE) --no-print-directory native && \
	TAILNET_RUN_OPERATOR=$(OPERATOR) $(PY) -m hack.localenv

# The cluster tests against kind: the same tests `make test` runs against the local node, on a
# kind cluster of three nodes made here without a registry (docs/kind.md); torn down afterwards.
e2e: $(VENV)/.native
	@$(PYTHON) -m hack.binaries build --set e2e
	$(PY) -m hack.kind e2e $(PYTEST_ARGS)

# The cluster tests only several nodes can run (the local node skips them by design): a node drain
# under the PodDisruptionBudget with two egress replicas. CI runs it on kind after make test.
MULTINODE_TESTS = test_egress_with_two_replicas_loses_nothing_when_a_node_is_drained
e2e-multinode: $(VENV)/.native
	@$(PYTHON) -m hack.binaries build --set e2e
	$(PY) -m hack.kind e2e -k "$(MULTINODE_TESTS)" $(PYTEST_ARGS)

# The Gateway API's conformance suite (GATEWAY-HTTP, GATEWAY-GRPC and GATEWAY-TLS profiles) with
# every feature the tailnet GatewayClass declares, against the local node (make test runs its core
# features), from a network namespace on the tailnet; the suite's ConformanceReport is written to
# docs/conformance/.
conformance: $(VENV)/.native
	@$(PYTHON) -m hack.binaries build --set test
	TAILNET_CONFORMANCE=full $(PY) -m pytest --tiers node e2e/test_gateway_conformance.py $(PYTEST_ARGS)

# The fuzz targets at length (`make test` runs each briefly). FUZZ_CASES inputs per Rust target.
FUZZ_CASES ?= 1000000
FUZZ_EXAMPLES ?= 2000
fuzz: $(VENV)/.native
	cd native && TAILNET_FUZZ_CASES=$(FUZZ_CASES) cargo test --release --quiet fuzz_ -- --nocapture --test-threads=1
	TAILNET_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest -q -p no:cacheprovider unit_tests/fuzz unit_tests/agent/fuzz

# The chaos driver at length (`make test` runs a few rounds in e2e/test_chaos.py); the seed is printed,
# CHAOS_SEED=N repeats a run. Host tier: its own etcd, kube-apiserver, Headscale, operators and agents.
CHAOS_ROUNDS ?= 24
chaos: $(VENV)/.native binaries-chaos
	TAILNET_CHAOS_ROUNDS=$(CHAOS_ROUNDS) $(if $(CHAOS_SEED),TAILNET_CHAOS_SEED=$(CHAOS_SEED)) \
	  $(PY) -m hack.chaos --json _artifacts/chaos.json

# BEFORE=DIR also measures an unpacked earlier tree in the big-cluster benchmark (e.g. git archive main).
bench: $(VENV)/.native binaries-bench
	$(PY) -m benchmarks.egress --json _artifacts/bench-egress.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.egress --kernel-peer --json _artifacts/bench-egress-kernel-peer.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.agent_profile --derp --json _artifacts/bench-agent-profile.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.agent_profile --kernel-peer --json _artifacts/bench-agent-profile-kernel-peer.json \
	  --doc docs/benchmarks.md
	$(PY) -m benchmarks.egress_incluster --json _artifacts/bench-egress-incluster.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.ingress_incluster --json _artifacts/bench-ingress-incluster.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.ingress_serve --json _artifacts/bench-ingress-serve.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.gateway_routing --json _artifacts/bench-gateway-routing.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.frontdoor_ready --json _artifacts/bench-frontdoor-ready.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.failover --json _artifacts/bench-failover.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.runtime --sizes 1000,5000,10000 --json _artifacts/bench-runtime.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.bigcluster --json _artifacts/bench-bigcluster.json --doc docs/benchmarks.md \
	  $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m benchmarks.policy --json _artifacts/bench-policy.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.policy_live --json _artifacts/bench-policy-live.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.disruption --rounds 3 --json _artifacts/bench-disruption.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.name_handover --json _artifacts/bench-name-handover.json --doc docs/benchmarks.md
	$(PY) -m benchmarks.tailnet_scale --sizes 200,1000 --rounds 3 --json _artifacts/bench-tailnet-scale.json \
	  --doc docs/benchmarks.md

# Every Headscale of the range with the newest tailscale, every tailscale with the newest Headscale;
# builds missing versions first and writes the results table into docs/compatibility.md.
interop: $(VENV)/.native binaries-interop
	$(PY) -m hack.interop $(INTEROP_ARGS)

clean:
	rm -rf $(VENV) _artifacts .pytest_cache .mypy_cache .ruff_cache
