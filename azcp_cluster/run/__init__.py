"""The run around the stages: the cluster's agreements, signals, the garbage collector held off,
progress and the report."""
