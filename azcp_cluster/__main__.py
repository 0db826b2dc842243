"""`python -m azcp_cluster` runs the command-line tool."""

from azcp_cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
