"""dspark_serve.models."""
