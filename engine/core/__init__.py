"""The engine core: a scheduler that plans each step and owns the KV blocks, an executor that runs a plan on the
models, and the EngineCore loop that joins them (schedule -> execute -> update)."""
