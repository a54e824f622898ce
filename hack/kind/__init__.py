"""`make e2e` against kind on this machine, with no registry: a dockerd of the run's own, a kind
node image assembled here from the pinned binaries, a cluster of one control plane and two workers
in 198.19.200.0/24, and a teardown that leaves nothing (docs/kind.md)."""
