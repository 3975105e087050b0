"""fxamp inside the trainers people use: accelerate, the transformers Trainer, torchtitan.

Each module imports its library when it is imported itself; `import fxamp` imports none of them
(docs/integrations.md).
"""
