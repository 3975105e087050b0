"""fxamp inside the trainers people use: Lightning, accelerate, the transformers Trainer,
torchtitan. Each module imports its framework when it is imported itself (import the one you
use, e.g. `fxamp.integrations.lightning`); `import fxamp` imports none of them
(docs/integrations.md)."""
