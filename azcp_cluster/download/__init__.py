"""The download: a rank's ranged GETs (its own HTTP/1.1 client reading into large buffers), its
block writes, and the worker processes that spread them over the node's cores."""
