"""dspark_serve.protos."""
