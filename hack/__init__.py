"""Development tooling: building the real binaries and running the local environment."""
