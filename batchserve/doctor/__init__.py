"""`batchserve doctor`: the seeds' troubleshooting (section 4.5) as a command. It watches a server (or reads a bench
trace), finds the situations the seeds name, and says what to change and by how much, asking the simulator for the
predicted effect of a knob at the observed arrival rate and lengths."""
