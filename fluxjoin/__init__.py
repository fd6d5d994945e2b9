"""The `fluxjoin` command: the composition root, the one package that may import every other.

`cli` builds the typer app from the commands of `run` (generator, instance, controller, operator, demo),
`operations` (an embedded broker, moves, status, verification, topics, ACLs) and `benchmarks`; `options`
holds what they share: option types, exit statuses, one-line errors and the configuration they name.
"""
