"""Step engines: the compiled tower step, one module per backend."""
