"""The `kvd` command line: serve, selftest, status, bench, demo."""
