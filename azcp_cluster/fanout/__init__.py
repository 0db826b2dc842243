"""The fan-out's driver over MPI: the fan-out engine between node writers and the streaming
protocol that feeds it as blocks land (its decisions are the pure core.fanout machine)."""
