"""The node's copy on disk: DEST's tree (temporary names, no links followed), O_DIRECT I/O, the
writer threads, the block journal, the lock, the manifest, and a local SOURCE's reading."""
