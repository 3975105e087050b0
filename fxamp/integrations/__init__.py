"""fxamp inside other trainers; each module imports its framework, so import the one you use
(`fxamp.integrations.lightning`): fxamp itself depends on none of them (docs/integrations.md)."""
