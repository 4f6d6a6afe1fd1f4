"""The host this process runs on, below everything that runs a model: the process-wide settings an entry point makes
once (torch's threads and seed, the C heap, OpenMP's workers) and the memory probes that size the KV pool. Front
ends, bench and the simulator take them from here, so that none of them reaches into the worker."""
