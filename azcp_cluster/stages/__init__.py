"""The stages of a run, one module each; ``pipeline.py`` runs them in order.

Each stage takes the run's context (``context.RunContext``: the configuration, the
cluster, the report, the handles that must be closed) and the frozen results of the
stages before it, does its rank-local work inside one agreement of all ranks, and
returns a frozen result of its own.
"""
