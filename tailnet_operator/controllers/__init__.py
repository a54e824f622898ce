"""The reconcilers: each turns CRs into desired state applied with server-side apply."""
