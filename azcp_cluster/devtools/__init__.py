"""Support for the demo, the tests and the benchmarks: a local Azurite emulator and datasets.

Nothing here is used by the tool at run time.
"""
