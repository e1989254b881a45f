"""dspark_serve.train: the DeepSpec DSpark training recipe (target regeneration, anchors, losses, checkpoints)."""
