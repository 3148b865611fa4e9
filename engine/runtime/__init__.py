"""Process plumbing for the local engine: loading a model by name (`loading`), CPU threads
(`cpu_threads`), and fault injection for the tests (`faults`)."""
