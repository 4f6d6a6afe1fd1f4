"""The serving layer under every front end: what a front end may ask of an engine (EngineClient), the checks and
limits it takes from the engine, chat templates, and engine outputs as protocol-neutral results."""
