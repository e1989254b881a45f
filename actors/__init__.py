"""dspark_serve.actors."""
