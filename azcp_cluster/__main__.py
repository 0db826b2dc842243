"""`python -m azcp_cluster` runs the command-line tool (as the ``azcp-cluster`` executable does)."""

from azcp_cluster.cli import command

if __name__ == "__main__":
    raise SystemExit(command())
