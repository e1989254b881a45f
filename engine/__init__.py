"""dspark_serve.engine."""
