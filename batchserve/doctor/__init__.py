"""`batchserve doctor`: the troubleshooting guide as a command. It watches a server (or reads a bench
trace), finds the situations the guide names, and says what to change and by how much, asking the simulator for the
predicted effect of a knob at the observed arrival rate and lengths."""
