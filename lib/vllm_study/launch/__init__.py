"""Starting and stopping a vLLM server: the machine, the server process, its start-up
log, ports, GPU slots and the guard that stops orphans. Knows nothing of a study."""
