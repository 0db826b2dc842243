"""The pure core: planning, the schedule, the fan-out's decisions, the arithmetic, the options'
values and the errors. No Azure, MPI, file system, sockets or event loop (tests/test_purity.py)."""
