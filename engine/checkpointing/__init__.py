"""Engine checkpoints on disk: one root, one ``global_step_{N}/`` directory per save, published
whole. Every rank writes its part into a temporary sibling; rank 0 writes ``manifest.json`` last
and renames the directory into place, so a directory without a readable manifest is not a
checkpoint and a save killed at any point leaves the previous one the latest. What is in the
files is the backend's business (its ``Checkpointing`` ability): this package receives that
ability and a description of the engine (head, backend, model, layout, config), never the Engine.
"""
