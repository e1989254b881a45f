"""dspark_serve.cluster."""
